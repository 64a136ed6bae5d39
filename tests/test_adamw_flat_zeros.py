"""A fresh AdamW given flat zero moments (``flat_zeros``) steps bit for bit as AdamW's own
first-step state, and the first flat save then hands out those buffers without a copy."""

import pytest
import torch

from flwr_isoloco.clients.adamw_state import adamw_to_flat, flat_zeros


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(pre: bool, fused: bool, steps: int = 4):
    model = _model(0)
    named = list(model.named_parameters())
    kw = {"fused": True} if fused else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    if pre:
        assert flat_zeros(opt, named)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 7, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt, named


@pytest.mark.parametrize("fused", [False, True])
def test_same_steps_bitwise(fused):
    a, oa, na = _train(False, fused)
    b, ob, nb = _train(True, fused)
    for (_, p), (_, q) in zip(na, nb, strict=True):
        assert torch.equal(p, q)
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[p][m], ob.state[q][m])
        assert float(oa.state[p]["step"]) == float(ob.state[q]["step"]) == 4.0
        assert oa.state[p]["step"].device == ob.state[q]["step"].device
    fa, fb = adamw_to_flat(oa, na), adamw_to_flat(ob, nb, share=True)
    for k in fa:
        assert torch.equal(fa[k], fb[k])


def test_first_save_shares_the_buffers():
    _, opt, named = _train(True, False, steps=2)
    p0 = named[0][1]
    before = opt.state[p0]["exp_avg"].data_ptr()
    first = adamw_to_flat(opt, named, share=True)
    assert first["exp_avg"].data_ptr() == before  # the buffers themselves: no copy
    _, fresh, fnamed = _train(False, False, steps=2)
    q0 = fnamed[0][1]
    own = fresh.state[q0]["exp_avg"].data_ptr()
    copied = adamw_to_flat(fresh, fnamed, share=True)  # AdamW's own state: concatenated
    assert copied["exp_avg"].data_ptr() != own
    assert torch.equal(first["exp_avg"], copied["exp_avg"])


def test_refused_when_state_or_dtypes_differ():
    model = _model(0)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters())
    opt.state[named[0][1]] = {"step": torch.tensor(1.0)}
    assert not flat_zeros(opt, named)
    model2 = _model(0).double()
    opt2 = torch.optim.AdamW(model2.parameters())
    assert not flat_zeros(opt2, list(model2.named_parameters()))
    assert not opt2.state
