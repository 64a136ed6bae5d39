"""OuterSGD is bitwise torch.optim.SGD (issue 9, item 7): kept for its update hook, not for
different numbers (see flwr_isoloco/merging/outer.py)."""

import pytest
import torch

from flwr_isoloco.merging.outer import OuterSGD


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.8, True)])
def test_bitwise_equal_to_torch_sgd(dtype, momentum, nesterov):
    g = torch.Generator().manual_seed(7)
    theta = {
        "embed": torch.randn(50, 16, generator=g, dtype=dtype),
        "norm": torch.ones(16, dtype=dtype),
    }
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in theta.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=momentum, nesterov=nesterov)
    ours = OuterSGD(lr=0.7, momentum=momentum, nesterov=nesterov)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, generator=g, dtype=dtype) * 1e-2 for k, v in theta.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
        theta = ours.step(theta, grads)
        for k in theta:
            assert torch.equal(theta[k], ref[k].detach()), k
    if momentum:
        for k, p in ref.items():
            assert torch.equal(ours.momentum_buffer[k], opt.state[p]["momentum_buffer"])
