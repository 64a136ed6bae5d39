"""OuterSGD against torch.optim.SGD, step by step, and its error handling."""

import pytest
import torch

from flwr_isoloco.merging.outer import OuterSGD

torch.set_num_threads(1)


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.w": torch.randn(4, 3, generator=g, dtype=dtype),
        "layer.b": torch.randn(3, generator=g, dtype=dtype),
    }


def _grads(step, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    return {
        "layer.w": torch.randn(4, 3, generator=g, dtype=dtype),
        "layer.b": torch.randn(3, generator=g, dtype=dtype),
    }


@pytest.mark.parametrize(
    "momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True), (0.5, True)]
)
def test_matches_torch_sgd_step_by_step(momentum, nesterov):
    params = _params()
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.SGD(
        list(ref.values()), lr=0.7, momentum=momentum, nesterov=nesterov, dampening=0
    )
    ours = OuterSGD(lr=0.7, momentum=momentum, nesterov=nesterov)
    for step in range(6):
        grads = _grads(step)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        params = ours.step(params, grads)
        for k in params:
            torch.testing.assert_close(params[k], ref[k].detach(), rtol=0, atol=1e-14)


def test_mu0_lr1_is_fedavg():
    theta = _params()
    workers = [_params(seed=s) for s in (1, 2, 3)]
    deltas = [{k: theta[k] - w[k] for k in theta} for w in workers]
    mean_delta = {k: sum(d[k] for d in deltas) / 3 for k in theta}
    new = OuterSGD(lr=1.0).step(theta, mean_delta)
    for k in theta:
        fedavg = sum(w[k] for w in workers) / 3
        torch.testing.assert_close(new[k], fedavg, rtol=0, atol=1e-12)


def test_inputs_untouched_and_bf16_round_trip():
    params = {"w": torch.randn(3, 3).to(torch.bfloat16)}
    grads = {"w": torch.ones(3, 3, dtype=torch.bfloat16)}
    before = params["w"].clone()
    opt = OuterSGD(lr=0.5, momentum=0.9, nesterov=True)
    out = opt.step(params, grads)
    assert torch.equal(params["w"], before)
    assert out["w"].dtype == torch.bfloat16
    assert opt.momentum_buffer["w"].dtype == torch.float32
    # first Nesterov step: u = g + mu*g = 1.9 g
    expected = (before.float() - 0.5 * 1.9).to(torch.bfloat16)
    assert torch.equal(out["w"], expected)


def test_update_transform_is_applied_after_momentum():
    params = _params()
    seen = {}

    def transform(u):
        seen.update({k: v.clone() for k, v in u.items()})
        return {k: 2 * v for k, v in u.items()}

    opt = OuterSGD(lr=0.1, momentum=0.9, nesterov=False)
    g0, g1 = _grads(0), _grads(1)
    p1 = opt.step(params, g0, update_transform=transform)
    p2 = opt.step(p1, g1, update_transform=transform)
    for k in params:
        buf = 0.9 * g0[k] + g1[k]  # heavy-ball buffer after two steps
        torch.testing.assert_close(seen[k], buf, rtol=0, atol=1e-14)
        torch.testing.assert_close(p2[k], p1[k] - 0.1 * 2 * buf, rtol=0, atol=1e-14)


def test_state_dict_round_trip_resumes_exactly():
    a = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    params = _params()
    for step in range(2):
        params = a.step(params, _grads(step))
    state = a.state_dict()
    b = OuterSGD(lr=99.0)
    b.load_state_dict(state)
    assert (b.lr, b.momentum, b.nesterov, b.steps) == (0.7, 0.9, True, 2)
    pa = a.step(params, _grads(2))
    pb = b.step(params, _grads(2))
    for k in pa:
        assert torch.equal(pa[k], pb[k])
    state["momentum_buffer"]["layer.w"].zero_()  # state_dict holds copies
    assert a.momentum_buffer["layer.w"].abs().sum() > 0


@pytest.mark.parametrize(
    "grads,match",
    [
        ({"layer.w": torch.zeros(4, 3, dtype=torch.float64)}, "key 'layer.b': missing"),
        ({**_grads(0), "extra": torch.zeros(1)}, "key 'extra'"),
        ({**_grads(0), "layer.b": torch.zeros(4)}, r"key 'layer.b': grad shape \(4,\)"),
        ({**_grads(0), "layer.w": torch.full((4, 3), float("nan"))}, "key 'layer.w': grad"),
    ],
)
def test_bad_grads_raise_and_leave_state(grads, match):
    opt = OuterSGD(lr=0.1, momentum=0.9)
    params = opt.step(_params(), _grads(0))
    before = {k: v.clone() for k, v in opt.momentum_buffer.items()}
    with pytest.raises(ValueError, match=match):
        opt.step(params, grads)
    assert opt.steps == 1
    for k in before:
        assert torch.equal(before[k], opt.momentum_buffer[k])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": 0.1, "momentum": -0.1}, "momentum"),
        ({"lr": 0.1, "nesterov": True}, "nesterov"),
    ],
)
def test_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OuterSGD(**kwargs)


def test_bad_update_transform_output():
    opt = OuterSGD(lr=0.1)
    with pytest.raises(ValueError, match="update_transform"):
        opt.step(_params(), _grads(0), update_transform=lambda u: {"layer.w": u["layer.w"]})
    assert opt.steps == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_transform_output_raises_and_changes_nothing(bad):
    """The docstring's promise: a non-finite transform output raises, momentum and steps stay."""
    opt = OuterSGD(lr=0.1, momentum=0.9, nesterov=True)
    params = opt.step(_params(), _grads(0))
    before = {k: v.clone() for k, v in opt.momentum_buffer.items()}

    def poison(u):
        return {k: torch.full_like(v, bad) for k, v in u.items()}

    with pytest.raises(ValueError, match="non-finite"):
        opt.step(params, _grads(1), update_transform=poison)
    assert opt.steps == 1
    for k in before:
        assert torch.equal(before[k], opt.momentum_buffer[k])


def test_overflowing_step_raises_and_changes_nothing():
    """Finite inputs whose ``theta - lr * u`` overflows fp32: refused, state kept."""
    opt = OuterSGD(lr=1e30, momentum=0.9)
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(params, {"w": torch.full((3,), 1e20)})
    assert opt.steps == 0 and opt.momentum_buffer == {}


def test_load_state_dict_rejects_garbage():
    with pytest.raises(ValueError, match="missing"):
        OuterSGD(lr=0.1).load_state_dict({"lr": 0.1})
