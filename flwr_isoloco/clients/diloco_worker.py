"""DiLoCo worker: ClientApp handlers that run H inner AdamW steps and reply FedAvg-style.

``make_diloco_train_handler`` loads the received model, restores the node's AdamW state from
``context.state`` (:mod:`flwr_isoloco.clients.adamw_state`; it never travels), runs H steps
with the learning rate of :func:`inner_lr` (warm-up, then cosine to ``min-lr-ratio`` over the
whole run), saves the state and replies ``theta_i`` (or the delta, compressed on request with
error feedback) with ``num-examples`` = predicted tokens. ``make_lm_evaluate_handler`` gives
the token-weighted validation loss. The message config keys, the state records and the reply
are specified in the repository's ``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies"), "The DiLoCo worker". Wrapped in
:func:`~flwr_isoloco.clients.node_state.with_node_state`, the state's ArrayRecords wait for the
next round in the node's state file rather than in ``context.state`` (in a simulation that is
the ServerApp's process).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from flwr_isoloco.compression import parse_request
from flwr_isoloco.merging.dp import CLIP_KEY, NOISE_KEY
from flwr_isoloco.models.hf import load_model_arrays

from .adamw_state import MOMENTS, adamw_to_arrays, adamw_to_flat, arrays_to_adamw, flat_to_adamw
from .worker_reply import RESIDUAL_STATE_KEY, reply_content

__all__ = [
    "make_diloco_train_handler",
    "make_lm_evaluate_handler",
    "next_token_loss",
    "inner_lr",
    "ADAMW_STATE_KEY",
    "WORKER_STATE_KEY",
    "RESIDUAL_STATE_KEY",
]

ADAMW_STATE_KEY = "diloco.adamw"
WORKER_STATE_KEY = "diloco.worker"

ModelFn = Callable[[Context], torch.nn.Module]
DataFn = Callable[[Context], Any]
LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int]]


def next_token_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy of an int batch ``(B, T+1)``, and ``B*T`` predicted tokens."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.size(1) < 2:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"expected an int tensor batch of shape (B, T+1) with T >= 1, got {shape}")
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
    )
    return loss, targets.numel()


def inner_lr(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Learning rate of global inner step ``s`` (0-based) of ``T = total``, warm-up ``W``::

        lr(s) = lr * (s + 1) / W                                          if s < W
        lr(s) = lr * (r + (1 - r) * (1 + cos(pi * min((s - W) / (T - W), 1))) / 2)   otherwise

    with ``r = min_ratio``. The worker's step is ``s = (server-round - 1) * H + h``,
    ``T = num-server-rounds * H``.

    Why not transformers' ``get_cosine_with_min_lr_schedule_with_warmup``: its decay part is
    bitwise this one (tested), but its warm-up is ``lr * s / W``, one step behind ours: the
    first inner step of a run would get lr 0 (a wasted step) and every warm-up step a
    different lr, so swapping would change every result (the LM demo's val loss included).
    Past ``total`` it also rises again (``cos`` is not clamped); ours stays at the minimum.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _config(msg: Message, key: str) -> Mapping[str, Any]:
    rec = msg.content.config_records.get(key)
    return rec if rec is not None else {}


def _get(cfg: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"train config is missing {key!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"train config {key!r} must be an int, got {value!r}")
    if kind is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"train config {key!r} must be a finite number, got {value!r}")
        value = float(value)
    return value


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _load_adamw(
    opt: torch.optim.AdamW, named: list[tuple[str, torch.nn.Parameter]], state: RecordDict
) -> bool:
    """Restore AdamW from ``state`` (:mod:`.adamw_state`, flat layout; the named layout is read
    too); False (fresh optimiser) if absent or unusable (a warning says why)."""
    rec = state.get(ADAMW_STATE_KEY)
    if not isinstance(rec, ArrayRecord):
        return False
    try:
        arrays = rec.to_torch_state_dict()
        if all(m in arrays for m in MOMENTS):
            flat_to_adamw(opt, named, arrays)
        else:
            arrays_to_adamw(opt, named, arrays, allow_extra=True)
    except ValueError as exc:
        log(WARNING, "DiLoCo worker: AdamW state unusable (%s); starting a fresh optimiser", exc)
        return False
    return True


def _save_adamw(
    opt: torch.optim.AdamW,
    named: list[tuple[str, torch.nn.Parameter]],
    state: RecordDict,
    layout: str,
) -> None:
    if layout == "flat":
        arrays = adamw_to_flat(opt, named)
    else:
        arrays = adamw_to_arrays(opt, named, step_arrays=True)[0]
    state[ADAMW_STATE_KEY] = ArrayRecord(arrays)


def _batch_at(data: Any, index: int, seed: int) -> Any:
    """Batch number ``index`` of this node: callable data, or a sequence in seeded epoch order."""
    if callable(data):
        return data(index)
    if not isinstance(data, Sequence):
        raise ValueError(
            f"data_fn must return a sequence of batches or a callable, got {type(data).__name__}"
        )
    n = len(data)
    if n == 0:
        raise ValueError("data_fn returned no training batches")
    epoch, pos = divmod(index, n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return data[int(torch.randperm(n, generator=g)[pos])]


def _chunks(batch: Any, micro_batch: int) -> list[Any]:
    """``batch`` split along dim 0 into pieces of ``micro_batch`` rows (0: the whole batch)."""
    if micro_batch <= 0:
        return [batch]
    if not isinstance(batch, torch.Tensor):
        raise ValueError(
            f"micro_batch needs tensor batches (split along dim 0), got {type(batch).__name__}"
        )
    return list(torch.split(batch, micro_batch, dim=0))


def _accumulate(model, named, batch, loss_fn, micro_batch: int) -> tuple[torch.Tensor, int]:
    """Gradient of the batch's mean loss, accumulated over micro-batches of ``m`` rows::

        L = sum_j n_j L_j / N,   grad L = (sum_j grad(n_j L_j)) / N,   N = sum_j n_j

    with ``L_j`` the mean loss of micro-batch ``j`` over its ``n_j`` predicted tokens: the
    full batch's loss and gradient up to fp32 rounding, at the activation memory of ``m`` rows.
    Returns ``(L, N)``."""
    parts = _chunks(batch, micro_batch)
    if len(parts) == 1:
        loss, n = loss_fn(model, batch)
        if torch.isfinite(loss):
            loss.backward()
        return loss.detach(), int(n)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for part in parts:
        loss, n = loss_fn(model, part)
        if not torch.isfinite(loss):
            return loss.detach(), int(n)
        (loss * int(n)).backward()
        total += float(loss.detach()) * int(n)
        count += int(n)
    for _, p in named:
        if p.grad is not None:
            p.grad.div_(count)
    return (total / count).float(), count


@dataclass(frozen=True)
class _Round:
    """One train message's settings: the factory's defaults overridden by its config."""

    rnd: int
    h: int
    rounds: int
    lr: float
    warm: int
    min_ratio: float
    wd: float
    clip: float
    request: tuple[str, dict, bool] | None
    dp: tuple[float, float] | None  # local DP (C, z) the server asked for, or None


def _round_settings(cfg: Mapping[str, Any], d: Mapping[str, Any]) -> _Round:
    """Read and check the message config (``d``: the factory's keyword defaults).

    Raises ValueError for a missing or ill-typed key, a count below 1, a warm-up longer than
    the run (``warmup-steps > num-server-rounds * local-steps``: the lr would never reach its
    peak and no decay step would exist) or a bad codec request, all before any training.
    """
    c = _Round(
        rnd=_get(cfg, "server-round", None, int),
        h=_get(cfg, "local-steps", d["local_steps"], int),
        rounds=_get(cfg, "num-server-rounds", d["num_server_rounds"], int),
        lr=_get(cfg, "lr", d["lr"], float),
        warm=_get(cfg, "warmup-steps", d["warmup_steps"], int),
        min_ratio=_get(cfg, "min-lr-ratio", d["min_lr_ratio"], float),
        wd=_get(cfg, "weight-decay", d["weight_decay"], float),
        clip=_get(cfg, "clip-norm", d["clip_norm"], float),
        request=parse_request(cfg),  # bad codec config -> ValueError
        dp=_local_dp_request(cfg),
    )
    if c.rnd < 1 or c.h < 1 or c.rounds < 1:
        raise ValueError(
            "server-round, local-steps and num-server-rounds must be >= 1, "
            f"got {c.rnd}, {c.h}, {c.rounds}"
        )
    if c.warm > c.rounds * c.h:
        raise ValueError(
            f"warmup-steps {c.warm} is longer than the run: num-server-rounds {c.rounds} x "
            f"local-steps {c.h} = {c.rounds * c.h} inner steps"
        )
    return c


def _inner_steps(
    model, opt, named, data, cursor, node_seed, c: _Round, loss_fn, device, micro_batch=0
):
    """Run ``c.h`` AdamW steps from batch ``cursor``; returns (losses, tokens, last lr, cursor)."""
    losses, tokens, step_lr = [], 0, c.lr
    for i in range(c.h):
        step_lr = inner_lr((c.rnd - 1) * c.h + i, c.rounds * c.h, c.lr, c.warm, c.min_ratio)
        for group in opt.param_groups:
            group["lr"] = step_lr
        batch = _batch_at(data, cursor, node_seed)
        if isinstance(batch, torch.Tensor):
            batch = batch.to(device)
        cursor += 1
        opt.zero_grad(set_to_none=True)
        loss, n = _accumulate(model, named, batch, loss_fn, micro_batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at inner step {i} of round {c.rnd}")
        if c.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], c.clip)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(n)
    return losses, tokens, step_lr, cursor


def _local_dp_request(cfg: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(C, z)`` when the train config asks for local DP (``dp-clipping-norm`` > 0)."""
    c = _get(cfg, CLIP_KEY, 0.0, float)
    z = _get(cfg, NOISE_KEY, 0.0, float)
    if not (math.isfinite(c) and math.isfinite(z) and c >= 0 and z >= 0):
        raise ValueError(f"train config {CLIP_KEY!r}={c!r} / {NOISE_KEY!r}={z!r}: need >= 0")
    return (c, z) if c > 0 else None


def _received_model(
    msg: Message, context: Context, model_fn: ModelFn, key: str, device: Any
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The message's arrays ``theta`` and the node's model (on ``device``) with them loaded."""
    if key not in msg.content.array_records:
        raise ValueError(f"train message has no ArrayRecord {key!r}")
    theta = msg.content.array_records[key].to_torch_state_dict()
    model = model_fn(context).to(device)
    load_model_arrays(model, theta)
    return theta, model


def _prepare_training(
    model: torch.nn.Module, gradient_checkpointing: bool
) -> list[tuple[str, torch.nn.Parameter]]:
    """Train mode, activations recomputed in the backward pass if asked (a Hugging Face
    model's method); the trainable parameters by name."""
    if gradient_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError("gradient_checkpointing needs a Hugging Face model")
        model.gradient_checkpointing_enable()
    model.train()
    return _trainable(model)


def _adamw(
    named: list[tuple[str, torch.nn.Parameter]],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    state: RecordDict,
) -> torch.optim.AdamW:
    """AdamW over ``named`` (eps 1e-8), its moments restored from ``state`` when usable."""
    opt = torch.optim.AdamW(
        [p for _, p in named], lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8
    )
    _load_adamw(opt, named, state)
    return opt


def _data_cursor(state: RecordDict) -> int:
    """Batches the node has drawn so far (0 on its first round)."""
    wstate = state.get(WORKER_STATE_KEY)
    return int(wstate["data-cursor"]) if isinstance(wstate, ConfigRecord) else 0


def _train_metrics(tokens: int, losses: list[float], step_lr: float, h: int) -> MetricRecord:
    """The reply's metrics: ``num-examples`` = predicted tokens, mean loss, last lr, H."""
    metrics = {"num-examples": tokens, "train-loss": sum(losses) / len(losses), "lr": step_lr}
    return MetricRecord({**metrics, "inner-steps": h})


def _one_of(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be " + " or ".join(map(repr, options)) + f", got {value!r}")


def _check_handler_options(micro_batch: object, payload: str, state_layout: str) -> None:
    """``ValueError`` naming the first of the train handler's options that is not allowed."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 0:
        raise ValueError(f"micro_batch must be an int >= 0, got {micro_batch!r}")
    _one_of("payload", payload, ("weights", "delta"))
    _one_of("state_layout", state_layout, ("flat", "named"))


def make_diloco_train_handler(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    loss_fn: LossFn = next_token_loss,
    lr: float = 1.38e-3,
    local_steps: int = 30,
    num_server_rounds: int | None = None,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    clip_norm: float = 1.0,
    payload: str = "weights",
    seed: int = 0,
    arrayrecord_key: str = "arrays",
    configrecord_key: str = "config",
    device: str | torch.device = "cpu",
    state_layout: str = "flat",
    micro_batch: int = 0,
    gradient_checkpointing: bool = False,
) -> Callable[[Message, Context], Message]:
    """A ClientApp ``@app.train()`` handler running H inner AdamW steps (the repository's ``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies")).

    Parameters
    ----------
    model_fn, data_fn, loss_fn :
        ``(context) -> Module`` the received ``arrays`` load into (strict); ``(context) ->`` the
        node's batches (a sequence, seeded order per epoch, or ``batch(step)``); ``(model,
        batch) -> (mean loss, predicted tokens)``.
    lr, local_steps, num_server_rounds, warmup_steps, min_lr_ratio, weight_decay, clip_norm :
        Defaults of the message config keys of the same names (:func:`inner_lr`).
    betas, payload, seed, arrayrecord_key, configrecord_key, device :
        AdamW betas; reply ``"weights"`` (FedAvg-style) or ``"delta"``; with the node's
        ``partition-id`` seeds batch order and dropout; record names; training device.
    state_layout :
        How the AdamW state is kept in ``context.state``: ``"flat"`` (three arrays) or
        ``"named"`` (three per parameter; same numbers, slower per message). Both are read.
    micro_batch, gradient_checkpointing :
        Memory: each inner step's batch is run in pieces of ``micro_batch`` rows with the
        gradient accumulated (0: in one piece; same step to fp32 rounding); recompute
        activations in the backward pass (``model.gradient_checkpointing_enable()``, a
        Hugging Face model's method).

    The received arrays load with :func:`flwr_isoloco.models.hf.load_model_arrays` (names and
    shapes checked; a tied tensor arrives once and the tie holds), and the reply has the same
    names as the message.
    """
    _check_handler_options(micro_batch, payload, state_layout)
    defaults = dict(local_steps=local_steps, num_server_rounds=num_server_rounds, lr=lr)
    defaults |= dict(warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)
    defaults |= dict(weight_decay=weight_decay, clip_norm=clip_norm)

    def train(msg: Message, context: Context) -> Message:
        c = _round_settings(_config(msg, configrecord_key), defaults)
        theta, model = _received_model(msg, context, model_fn, arrayrecord_key, device)
        names = list(theta)
        if c.request is None and payload == "weights" and c.dp is None:
            theta = None  # a plain weights reply does not need theta: one model copy less
        named = _prepare_training(model, gradient_checkpointing)
        opt = _adamw(named, c.lr, betas, c.wd, context.state)
        cursor = _data_cursor(context.state)
        node_seed = seed * 1_000_003 + int(context.node_config.get("partition-id", context.node_id))
        data = data_fn(context)
        torch.manual_seed(node_seed * 7919 + c.rnd)  # dropout etc., reproducible per round
        losses, tokens, step_lr, cursor = _inner_steps(
            model, opt, named, data, cursor, node_seed, c, loss_fn, device, micro_batch
        )
        _save_adamw(opt, named, context.state, state_layout)
        context.state[WORKER_STATE_KEY] = ConfigRecord({"data-cursor": cursor, "last-round": c.rnd})
        new = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in set(names)}
        content = reply_content(
            theta, new, c.request, payload, context.state, arrayrecord_key, c.dp
        )
        content["metrics"] = _train_metrics(tokens, losses, step_lr, c.h)
        return Message(content, reply_to=msg)

    return train


def make_lm_evaluate_handler(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    loss_fn: LossFn = next_token_loss,
    max_batches: int | None = None,
    arrayrecord_key: str = "arrays",
    device: str | torch.device = "cpu",
) -> Callable[[Message, Context], Message]:
    """A ClientApp ``@app.evaluate()`` handler: token-weighted validation loss of ``theta``.

    Replies ``num-examples`` (predicted tokens), ``eval-loss`` and ``eval-ppl = exp(eval-loss)``.
    ``data_fn(context)`` returns a sequence of validation batches.
    """

    def evaluate(msg: Message, context: Context) -> Message:
        if arrayrecord_key not in msg.content.array_records:
            raise ValueError(f"evaluate message has no ArrayRecord {arrayrecord_key!r}")
        model = model_fn(context).to(device)
        load_model_arrays(model, msg.content.array_records[arrayrecord_key])
        model.eval()
        batches = list(data_fn(context))
        if max_batches is not None:
            batches = batches[:max_batches]
        if not batches:
            raise ValueError("data_fn returned no validation batches")
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, torch.Tensor):
                    batch = batch.to(device)
                loss, n = loss_fn(model, batch)
                total += float(loss) * int(n)
                count += int(n)
        mean = total / count
        metrics = {"num-examples": count, "eval-loss": mean, "eval-ppl": math.exp(min(mean, 50.0))}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return evaluate
