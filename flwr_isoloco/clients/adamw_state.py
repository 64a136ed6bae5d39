"""AdamW state as plain named tensors (no pickle): the one codec both clients use.

Names, per trainable parameter ``<param>`` (its ``named_parameters`` name):

- ``<param>.exp_avg``, ``<param>.exp_avg_sq``: the first and second moments, fp32;
- ``<param>.step`` (fp32, shape ``(1,)``), only with ``step_arrays=True``: the step count per
  parameter. Without it the step is one int next to the arrays (all parameters step together).

The flat layout (:func:`adamw_to_flat`) holds the same numbers in three arrays: ``exp_avg`` and
``exp_avg_sq``, every parameter's moment flattened and concatenated in ``named`` order, and
``step`` (fp32, one entry per parameter). The DiLoCo worker keeps it in ``context.state``
(ArrayRecord ``diloco.adamw``): three arrays instead of three per parameter, because each
Flower ``Array`` costs a ``.npy`` encode/decode (~70 us) on every message and a 40-tensor
model's named state made that a third of a small worker's time per message. The LoRA client
carries the named moments with the RW-LoRA token (ArrayRecord ``optimizer``) and the step in
ConfigRecord ``optimizer-config``. Restoring puts
every moment on its parameter's device and dtype (and the step count there too for a fused or
capturable optimiser, whose kernels read it on the device; on the CPU otherwise), so a save/restore round-trip continues
exactly where the optimiser stopped (the repository's ``tests/test_lora_client.py``: K + K steps == 2K steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "MOMENTS",
    "adamw_to_arrays",
    "arrays_to_adamw",
    "adamw_to_flat",
    "flat_to_adamw",
    "flat_zeros",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW state entries stored per parameter (besides its step)."""

Named = Sequence[tuple[str, torch.nn.Parameter]]


def _step_tensor(opt: torch.optim.Optimizer, p: torch.Tensor, step: float) -> torch.Tensor:
    """The fp32 step count as ``opt`` keeps it: on ``p``'s device for a fused or capturable
    optimiser, on the CPU otherwise (what ``torch.optim.AdamW`` itself creates)."""
    on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
    return torch.tensor(step, dtype=torch.float32, device=p.device if on_device else "cpu")


def adamw_to_arrays(
    opt: torch.optim.Optimizer, named: Named, *, step_arrays: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """The state of ``opt`` for ``named`` as ``({f"{param}.{entry}": fp32 tensor}, step)``.

    Parameters without state (never stepped) are left out. ``step`` is the common step count
    (0 without state). Without ``step_arrays`` the step counts must agree across parameters
    (ValueError otherwise: one int cannot hold them); with it each is kept as
    ``<param>.step`` and ``step`` is the largest.
    """
    out: dict[str, torch.Tensor] = {}
    steps: set[int] = set()
    for name, p in named:
        st = opt.state.get(p)
        if not st:
            continue
        for m in MOMENTS:
            if m in st:
                out[f"{name}.{m}"] = st[m].detach().to(torch.float32).clone()
        if "step" in st:
            step = torch.as_tensor(st["step"])
            steps.add(int(step.item()))
            if step_arrays:
                out[f"{name}.step"] = step.detach().to(torch.float32).reshape(1).clone()
    if len(steps) > 1 and not step_arrays:
        raise ValueError(f"AdamW step counts differ across parameters: {sorted(steps)}")
    return out, (max(steps) if steps else 0)


def arrays_to_adamw(
    opt: torch.optim.Optimizer,
    named: Named,
    arrays: Mapping[str, torch.Tensor],
    step: int | None = None,
    *,
    allow_extra: bool = False,
) -> None:
    """Inverse of :func:`adamw_to_arrays`: set ``opt.state`` of every parameter in ``named``.

    Parameters
    ----------
    arrays :
        ``<param>.exp_avg`` and ``<param>.exp_avg_sq`` for every parameter, plus
        ``<param>.step`` (one entry) when ``step`` is None.
    step :
        The common step count (an int >= 0), or None to read ``<param>.step``.
    allow_extra :
        Ignore names that belong to no parameter in ``named`` (otherwise refused).

    Raises
    ------
    ValueError
        On missing (or, unless ``allow_extra``, unexpected) names, a moment whose shape is not
        its parameter's, a bad step. Nothing is changed in ``opt`` then.
    """
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"optimizer-config step must be an int >= 0, got {step!r}")
    entries = MOMENTS if step is not None else (*MOMENTS, "step")
    expected = {f"{n}.{m}" for n, _ in named for m in entries}
    missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing or (extra and not allow_extra):
        raise ValueError(
            f"optimizer state keys differ: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    restored = {}
    for name, p in named:
        ea, eas = (torch.as_tensor(arrays[f"{name}.{m}"]) for m in MOMENTS)
        if ea.shape != p.shape or eas.shape != p.shape:
            raise ValueError(
                f"optimizer state for {name!r}: shape {tuple(ea.shape)} != {tuple(p.shape)}"
            )
        if step is None:
            s = torch.as_tensor(arrays[f"{name}.step"])
            if s.numel() != 1:
                raise ValueError(f"optimizer state for {name!r}: step has shape {tuple(s.shape)}")
            s = float(s.reshape(()))
        else:
            s = float(step)
        restored[p] = {
            "step": _step_tensor(opt, p, s),
            "exp_avg": ea.to(device=p.device, dtype=p.dtype).clone(),
            "exp_avg_sq": eas.to(device=p.device, dtype=p.dtype).clone(),
        }
    for p, st in restored.items():
        opt.state[p] = st


def _packed(opt: torch.optim.Optimizer, named: Named) -> dict[str, torch.Tensor] | None:
    """The flat buffers ``opt``'s moments are views of, in ``named`` order, or None when they
    are not (a fresh optimiser, a parameter without state, another dtype or layout)."""
    out = {}
    for m in MOMENTS:
        base, off = None, 0
        for _, p in named:
            t = (opt.state.get(p) or {}).get(m)
            if t is None or t.dtype != torch.float32 or not t.is_contiguous():
                return None
            base = t._base if base is None else base
            if base is None or t._base is not base:
                return None
            if t.storage_offset() - base.storage_offset() != off:
                return None
            off += p.numel()
        if base is None or base.dim() != 1 or base.numel() != off or not base.is_contiguous():
            return None
        out[m] = base
    return out


def _share(opt: torch.optim.Optimizer, named: Named, flat: Mapping[str, torch.Tensor]) -> None:
    """Make every stepped parameter's moments views of ``flat`` (same values, no copy)."""
    off = 0
    for _, p in named:
        st, n = opt.state.get(p), p.numel()
        if st and all(m in st for m in MOMENTS):
            for m in MOMENTS:
                st[m] = flat[m][off : off + n].view(p.shape)
        off += n


def flat_zeros(opt: torch.optim.Optimizer, named: Named) -> bool:
    """Give a fresh ``opt`` the state AdamW creates on its first step (step 0, zero moments),
    its moments views of two flat zero buffers in ``named`` order; True if it did.

    The arithmetic is AdamW's own (its first step finds the state it would have made), but
    :func:`adamw_to_flat` with ``share=True`` then hands the buffers out as they are: without
    this, a fresh optimiser's moments are concatenated at the first save, and both copies are
    alive at once (1 GB more at the peak of a 135M node's first message). Only when no
    parameter has state yet and every one is fp32 on one device (else nothing is done)."""
    params = [p for _, p in named]
    if not params or any(opt.state.get(p) for p in params):
        return False
    if any(p.dtype != torch.float32 or p.device != params[0].device for p in params):
        return False
    n = sum(p.numel() for p in params)
    flat = {m: torch.zeros(n, dtype=torch.float32, device=params[0].device) for m in MOMENTS}
    off = 0
    for p in params:
        k = p.numel()
        st = {"step": _step_tensor(opt, p, 0.0)}
        st.update({m: flat[m][off : off + k].view(p.shape) for m in MOMENTS})
        opt.state[p] = st
        off += k
    return True


def adamw_to_flat(
    opt: torch.optim.Optimizer, named: Named, *, share: bool = False
) -> dict[str, torch.Tensor]:
    """The state of ``opt`` for ``named`` in the flat layout: ``exp_avg``, ``exp_avg_sq`` (fp32,
    length ``sum(p.numel())``, ``named`` order) and ``step`` (fp32, ``len(named)``). A parameter
    without state has zero moments and step 0, which is what AdamW creates on its first step;
    those zeros are made on the parameter's device (fp32, as every moment here), where AdamW
    keeps the other parameters' moments, so the concatenation works on any device.

    ``share=True`` returns the optimiser's own memory: after the concatenation every moment
    becomes a view of the returned buffers (AdamW updates its moments in place, foreach and
    fused kernels too), so the next call returns them without copying (at 135M the copy was
    0.5 s of a CPU message). The caller must copy them before ``opt`` steps again, as
    ``ArrayRecord`` does when it serialises them. Default: fresh tensors."""
    if not named:
        return {}
    steps = torch.zeros(len(named), dtype=torch.float32)
    for i, (_, p) in enumerate(named):
        st = opt.state.get(p) or {}
        if "step" in st:
            steps[i] = float(torch.as_tensor(st["step"]).item())
    packed = _packed(opt, named) if share else None
    if packed is not None:
        return {**packed, "step": steps}
    parts: dict[str, list[torch.Tensor]] = {m: [] for m in MOMENTS}
    for _, p in named:
        st = opt.state.get(p) or {}
        for m in MOMENTS:
            t = st.get(m)
            parts[m].append(
                torch.zeros(p.numel(), device=p.device, dtype=torch.float32)
                if t is None
                else t.detach().reshape(-1).to(torch.float32)
            )
    flat = {m: torch.cat(parts[m]) for m in MOMENTS}
    if share and all(p.dtype == torch.float32 for _, p in named):
        _share(opt, named, flat)
    return {**flat, "step": steps}


def flat_to_adamw(
    opt: torch.optim.Optimizer, named: Named, arrays: Mapping[str, torch.Tensor]
) -> None:
    """Inverse of :func:`adamw_to_flat`; parameters with step 0 get no state (a fresh start).

    Raises
    ------
    ValueError
        A missing array, lengths that do not match ``named`` or a step that is not a finite
        integer >= 0. Nothing is changed in ``opt`` then.
    """
    missing = [k for k in (*MOMENTS, "step") if k not in arrays]
    if missing:
        raise ValueError(f"flat optimizer state: missing {missing}")
    total = sum(p.numel() for _, p in named)
    flat = {m: torch.as_tensor(arrays[m]).reshape(-1) for m in MOMENTS}
    steps = torch.as_tensor(arrays["step"]).reshape(-1)
    for m, t in flat.items():
        if t.numel() != total:
            raise ValueError(f"flat optimizer state: {m} has {t.numel()} values, the model {total}")
    if steps.numel() != len(named):
        raise ValueError(f"flat optimizer state: {steps.numel()} steps for {len(named)} parameters")
    if (
        not bool(torch.isfinite(steps).all())
        or bool((steps < 0).any())
        or bool((steps != steps.round()).any())
    ):
        raise ValueError("flat optimizer state: steps must be integers >= 0")
    restored, off = {}, 0
    for i, (_, p) in enumerate(named):
        n = p.numel()
        if steps[i] > 0:
            restored[p] = {
                "step": _step_tensor(opt, p, float(steps[i])),
                **{
                    m: flat[m][off : off + n].reshape(p.shape).to(p.device, p.dtype).clone()
                    for m in MOMENTS
                },
            }
        off += n
    for p, st in restored.items():
        opt.state[p] = st
