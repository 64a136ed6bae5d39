"""The one AdamW state codec (flwr_isoloco.clients.adamw_state) of the DiLoCo and LoRA clients."""

import pytest
import torch

from flwr_isoloco.clients.adamw_state import (
    MOMENTS,
    adamw_to_arrays,
    adamw_to_flat,
    arrays_to_adamw,
    flat_to_adamw,
)

torch.set_num_threads(1)


def _model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    return m, list(m.named_parameters())


def _steps(model, opt, n, start=0):
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _opt(named):
    return torch.optim.AdamW([p for _, p in named], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _continues_bitwise(save, restore):
    """3 steps, ``save(opt, named)``, a fresh model + optimiser given the saved state by
    ``restore(opt, named, state)``, 2 more steps == 5 uninterrupted steps, bitwise. Returns
    the saved state."""
    ref, ref_named = _model()
    _steps(ref, _opt(ref_named), 5)
    a, a_named = _model()
    a_opt = _opt(a_named)
    _steps(a, a_opt, 3)
    state = save(a_opt, a_named)
    b, b_named = _model()
    b.load_state_dict(a.state_dict())
    b_opt = _opt(b_named)
    restore(b_opt, b_named, state)
    _steps(b, b_opt, 2, start=3)
    for (_, p), (_, q) in zip(ref_named, b_named, strict=True):
        assert torch.equal(p, q)
    return state


@pytest.mark.parametrize("step_arrays", [False, True])
def test_save_restore_continues_bitwise(step_arrays):
    """3 steps, save, a fresh model + optimiser restored from the arrays, 2 more == 5 steps."""
    saved = {}

    def save(opt, named):
        saved["arrays"], saved["step"] = adamw_to_arrays(opt, named, step_arrays=step_arrays)
        return saved["arrays"]

    _continues_bitwise(
        save,
        lambda opt, named, arrays: arrays_to_adamw(
            opt, named, arrays, None if step_arrays else saved["step"]
        ),
    )
    assert saved["step"] == 3


def test_names_dtypes_and_step():
    m, named = _model()
    opt = _opt(named)
    _steps(m, opt, 2)
    arrays, step = adamw_to_arrays(opt, named)
    assert step == 2
    assert sorted(arrays) == sorted(f"{n}.{e}" for n, _ in named for e in MOMENTS)
    assert all(t.dtype == torch.float32 for t in arrays.values())
    with_steps, _ = adamw_to_arrays(opt, named, step_arrays=True)
    assert set(with_steps) - set(arrays) == {f"{n}.step" for n, _ in named}
    assert all(with_steps[f"{n}.step"].tolist() == [2.0] for n, _ in named)
    # copies: stepping on does not change what was saved
    before = arrays["0.weight.exp_avg"].clone()
    _steps(m, opt, 1, start=2)
    assert torch.equal(arrays["0.weight.exp_avg"], before)


def test_no_state_gives_nothing():
    _, named = _model()
    assert adamw_to_arrays(_opt(named), named) == ({}, 0)


def test_bad_arrays_are_refused_and_leave_the_optimiser_alone():
    m, named = _model()
    opt = _opt(named)
    _steps(m, opt, 1)
    arrays, step = adamw_to_arrays(opt, named)
    fresh = _opt(named)

    missing = {k: v for k, v in arrays.items() if k != "2.bias.exp_avg_sq"}
    with pytest.raises(ValueError, match=r"missing \['2.bias.exp_avg_sq'\], unexpected \[\]"):
        arrays_to_adamw(fresh, named, missing, step)
    extra = {**arrays, "ghost.exp_avg": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected \['ghost.exp_avg'\]"):
        arrays_to_adamw(fresh, named, extra, step)
    arrays_to_adamw(_opt(named), named, extra, step, allow_extra=True)  # e.g. node-local state
    shape = {**arrays, "2.weight.exp_avg": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match=r"state for '2.weight': shape \(3, 2\) != \(2, 3\)"):
        arrays_to_adamw(fresh, named, shape, step)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            arrays_to_adamw(fresh, named, arrays, bad)
    with pytest.raises(ValueError, match="missing .*step"):
        arrays_to_adamw(fresh, named, arrays, None)  # per-parameter steps asked, none stored
    assert not fresh.state


def test_step_counts_that_differ_need_step_arrays():
    m, named = _model()
    opt = _opt(named)
    _steps(m, opt, 1)
    named[0][1].grad = torch.zeros_like(named[0][1])  # only the first parameter steps again
    opt.step()
    with pytest.raises(ValueError, match=r"step counts differ across parameters: \[1, 2\]"):
        adamw_to_arrays(opt, named)
    arrays, step = adamw_to_arrays(opt, named, step_arrays=True)
    assert step == 2 and arrays["0.weight.step"].item() == 2 and arrays["0.bias.step"].item() == 1


def test_flat_layout_continues_bitwise_and_equals_the_named_layout():
    """3 steps, flat save, restore into a fresh model + optimiser, 2 more == 5 steps; the flat
    arrays are the named ones concatenated in parameter order."""
    named_saved = {}

    def save(opt, named):
        named_saved["arrays"], _ = adamw_to_arrays(opt, named)
        named_saved["names"] = [n for n, _ in named]
        return adamw_to_flat(opt, named)

    flat = _continues_bitwise(save, flat_to_adamw)
    assert sorted(flat) == sorted((*MOMENTS, "step"))
    arrays = named_saved["arrays"]
    for m in MOMENTS:
        cat = torch.cat([arrays[f"{n}.{m}"].reshape(-1) for n in named_saved["names"]])
        assert torch.equal(flat[m], cat)
    assert flat["step"].tolist() == [3.0] * len(named_saved["names"])


def test_flat_layout_keeps_unstepped_parameters_fresh_and_refuses_bad_arrays():
    m, named = _model()
    opt = _opt(named)
    _steps(m, opt, 1)
    named[0][1].grad = torch.zeros_like(named[0][1])  # only the first parameter steps again
    opt.step()
    flat = adamw_to_flat(opt, named)
    assert flat["step"].tolist() == [2.0, 1.0, 1.0, 1.0]
    fresh = _opt(named)
    flat_to_adamw(fresh, named, {**flat, "step": torch.tensor([2.0, 0.0, 1.0, 1.0])})
    assert named[1][1] not in fresh.state and fresh.state[named[0][1]]["step"].item() == 2
    assert adamw_to_flat(_opt(named), named)["step"].tolist() == [0.0] * 4  # no state: zeros
    bad = {
        "missing": ({k: v for k, v in flat.items() if k != "exp_avg"}, r"missing \['exp_avg'\]"),
        "short": (
            {**flat, "exp_avg_sq": flat["exp_avg_sq"][:-1]},
            "exp_avg_sq has 22 values, the model 23",
        ),
        "steps": ({**flat, "step": flat["step"][:3]}, "3 steps for 4 parameters"),
        "neg": ({**flat, "step": torch.tensor([1.0, -1.0, 1.0, 1.0])}, "integers >= 0"),
        "frac": ({**flat, "step": torch.tensor([1.5, 1.0, 1.0, 1.0])}, "integers >= 0"),
        "nan": ({**flat, "step": torch.tensor([float("nan"), 1.0, 1.0, 1.0])}, "integers >= 0"),
    }
    for arrays, match in bad.values():
        fresh = _opt(named)
        with pytest.raises(ValueError, match=match):
            flat_to_adamw(fresh, named, arrays)
        assert not fresh.state


def test_flat_layout_pads_unstepped_parameters_on_their_device():
    """A model off the CPU (here the ``meta`` device: no GPU needed) with one parameter that
    never stepped: its zero moments are made on that device, so the flat arrays concatenate."""
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = list(m.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named])
    p0 = named[0][1]
    opt.state[p0] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros_like(p0),
        "exp_avg_sq": torch.zeros_like(p0),
    }
    flat = adamw_to_flat(opt, named)
    total = sum(p.numel() for _, p in named)
    for moment in MOMENTS:
        assert flat[moment].device.type == "meta" and flat[moment].shape == (total,)
        assert flat[moment].dtype == torch.float32
    assert flat["step"].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", ["foreach", "fused", "single"])
def test_shared_flat_layout_copies_once_and_trains_bitwise(kind):
    """share=True: the first call concatenates and makes the moments views of its buffers; the
    next calls return those buffers (same memory, no copy) with the current values; training
    with the views is bitwise the training without them (AdamW updates moments in place)."""
    opts = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single": {"foreach": False}}

    def opt_of(named):
        return torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.1, **opts[kind])

    ref, ref_named = _model()
    ref_opt = opt_of(ref_named)
    a, a_named = _model()
    a_opt = opt_of(a_named)
    _steps(ref, ref_opt, 2)
    _steps(a, a_opt, 2)
    first = adamw_to_flat(a_opt, a_named, share=True)
    for step in range(2, 6):
        _steps(ref, ref_opt, 1, start=step)
        _steps(a, a_opt, 1, start=step)
        shared = adamw_to_flat(a_opt, a_named, share=True)
        copied = adamw_to_flat(ref_opt, ref_named)
        for m in MOMENTS:
            assert shared[m].data_ptr() == first[m].data_ptr()  # no new buffer
            assert torch.equal(shared[m], copied[m])
        assert torch.equal(shared["step"], copied["step"])
    for (_, p), (_, q) in zip(ref_named, a_named, strict=True):
        assert torch.equal(p, q)
    # the default still returns fresh tensors: stepping on does not change them
    fresh = adamw_to_flat(a_opt, a_named)
    before = fresh["exp_avg"].clone()
    _steps(a, a_opt, 1, start=6)
    assert torch.equal(fresh["exp_avg"], before)
    assert fresh["exp_avg"].data_ptr() != first["exp_avg"].data_ptr()
