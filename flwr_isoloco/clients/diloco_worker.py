"""DiLoCo worker: ClientApp handlers that run H inner AdamW steps and reply FedAvg-style.

``make_diloco_train_handler`` loads the received model, restores the node's AdamW state from
``context.state`` (:mod:`flwr_isoloco.clients.adamw_state`; it never travels), runs H steps
(:mod:`.inner_loop`) with the learning rate of :func:`inner_lr` (warm-up, then cosine to
``min-lr-ratio`` over the whole run), saves the state and replies ``theta_i`` (or the delta,
compressed on request with error feedback) with ``num-examples`` = predicted tokens. Its
settings are two objects (:mod:`.worker_settings`): ``train=TrainSettings(...)``, the inner
loop's optimisation (the defaults of the message config keys), and ``runtime=Runtime(...)``,
where and how it runs. ``make_lm_evaluate_handler`` gives the token-weighted validation loss.
The message config keys, the state records and the reply are specified in the repository's
``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies"), "The DiLoCo worker". Wrapped in
:func:`~flwr_isoloco.clients.node_state.with_node_state`, the state's ArrayRecords wait for the
next round in the node's state file rather than in ``context.state`` (in a simulation that is
the ServerApp's process).

Both run on a device (``"auto"``: the GPU the process sees, else the CPU) in a precision
(:mod:`.precision`: autocast, fp32 master weights and moments); the train handler optionally
compiles the model and keeps it and the node's moments on the device between messages of one
process (:mod:`.worker_cache`; the stored state is written as without it). Whatever the
device, the reply and the stored state are fp32 on the CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from flwr_isoloco.compression import parse_request
from flwr_isoloco.merging.device import resolve_node_device
from flwr_isoloco.merging.dp import CLIP_KEY, NOISE_KEY
from flwr_isoloco.models.hf import load_model_arrays
from flwr_isoloco.settings_tools import renamed_fields

from .inner_loop import Amp, InnerLoop, Pace, accumulate, inner_lr
from .inner_loop import inner_steps as _inner_steps
from .precision import announce, autocast, check_precision, grad_scaler
from .record_io import unpack_record
from .worker_cache import ADAMW_STATE_KEY, borrow_model, restore_moments, store_moments
from .worker_reply import RESIDUAL_STATE_KEY, reply_content
from .worker_settings import RUNTIME_FIELDS, TRAIN_FIELDS, Runtime, TrainSettings

__all__ = [
    "MOVED_KEYWORDS",
    "make_diloco_train_handler",
    "make_lm_evaluate_handler",
    "next_token_loss",
    "inner_lr",
    "ADAMW_STATE_KEY",
    "WORKER_STATE_KEY",
    "RESIDUAL_STATE_KEY",
    "TIME_BUDGET_KEY",
]

WORKER_STATE_KEY = "diloco.worker"
TIME_BUDGET_KEY = "time-budget-s"
"""Message config key overriding ``TrainSettings.time_budget_s`` (seconds; 0 = off)."""

ModelFn = Callable[[Context], torch.nn.Module]
DataFn = Callable[[Context], Any]
LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int]]
_accumulate = accumulate  # the name the worker's tests and benchmarks know


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
    budget: float = 0.0  # time-budget-s: inner steps until it is spent (0 = all H)


def _round_settings(cfg: Mapping[str, Any], d: TrainSettings) -> _Round:
    """Read and check the message config (``d``: its defaults).

    Raises ValueError for a missing or ill-typed key, a count below 1, a warm-up longer than
    the run (``warmup-steps > num-server-rounds * local-steps``: the lr would never reach its
    peak and no decay step would exist) or a bad codec request, all before any training.
    """
    c = _Round(
        rnd=_get(cfg, "server-round", None, int),
        h=_get(cfg, "local-steps", d.local_steps, int),
        rounds=_get(cfg, "num-server-rounds", d.num_server_rounds, int),
        lr=_get(cfg, "lr", d.lr, float),
        warm=_get(cfg, "warmup-steps", d.warmup_steps, int),
        min_ratio=_get(cfg, "min-lr-ratio", d.min_lr_ratio, float),
        wd=_get(cfg, "weight-decay", d.weight_decay, float),
        clip=_get(cfg, "clip-norm", d.clip_norm, float),
        request=parse_request(cfg),  # bad codec config -> ValueError
        dp=_local_dp_request(cfg),
        budget=_get(cfg, TIME_BUDGET_KEY, d.time_budget_s, float),
    )
    if c.budget < 0:
        raise ValueError(f"{TIME_BUDGET_KEY} must be >= 0 (0 = off), got {c.budget!r}")
    if c.budget > 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ValueError(
            f"{TIME_BUDGET_KEY} with a distributed worker: each rank would time its own steps "
            "and the ranks could run different step counts (a hung collective); use 0"
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


def _local_dp_request(cfg: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(C, z)`` when the train config asks for local DP (``dp-clipping-norm`` > 0)."""
    c = _get(cfg, CLIP_KEY, 0.0, float)
    z = _get(cfg, NOISE_KEY, 0.0, float)
    if not (math.isfinite(c) and math.isfinite(z) and c >= 0 and z >= 0):
        raise ValueError(f"train config {CLIP_KEY!r}={c!r} / {NOISE_KEY!r}={z!r}: need >= 0")
    return (c, z) if c > 0 else None


def _received_arrays(msg: Message, key: str) -> dict[str, torch.Tensor]:
    """The message's arrays ``theta`` (on the CPU, read-only views of the message's bytes:
    :func:`.record_io.unpack_record`)."""
    if key not in msg.content.array_records:
        raise ValueError(f"train message has no ArrayRecord {key!r}")
    return unpack_record(msg.content.array_records[key])


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
    fused: bool,
) -> torch.optim.AdamW:
    """AdamW over ``named`` (eps 1e-8); ``fused`` selects torch's one-kernel implementation."""
    kw = {"fused": True} if fused else {}
    return torch.optim.AdamW(
        [p for _, p in named], lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8, **kw
    )


def _use_fused_adamw(device: torch.device) -> bool:
    """Fused AdamW (one kernel for every parameter's update instead of a few ops per parameter)
    on the devices torch has the kernel for, CUDA and the CPU. On the CPU at the LM demo's model
    its step took 1.6 ms against 5.2 ms for the default (4.6 ms foreach, bitwise the default),
    out of a ~70 ms inner step; it rounds differently in the last bits (the demo's validation
    loss 4.5139327 against 4.5139331)."""
    return device.type in ("cuda", "cpu")


def _data_cursor(state: RecordDict) -> int:
    """Batches the node has drawn so far (0 on its first round)."""
    wstate = state.get(WORKER_STATE_KEY)
    return int(wstate["data-cursor"]) if isinstance(wstate, ConfigRecord) else 0


def _train_metrics(tokens: int, losses: list[float], step_lr: float, c: _Round, amp: Amp, spent):
    """The reply's metrics: ``num-examples`` = predicted tokens, mean loss, last lr, the inner
    steps run (fp16: and the steps the scaler skipped; with a time budget: the H asked, the
    budget and the measured seconds per step, ``spent`` / steps)."""
    metrics = {"num-examples": tokens, "train-loss": sum(losses) / len(losses), "lr": step_lr}
    if amp.scaler is not None:
        metrics["skipped-steps"] = amp.skipped
    metrics["inner-steps"] = len(losses)
    if c.budget > 0:
        metrics |= {"inner-steps-asked": c.h, TIME_BUDGET_KEY: c.budget}
        metrics["step-time-s"] = spent / len(losses)
    return MetricRecord(metrics)


def _one_of(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be " + " or ".join(map(repr, options)) + f", got {value!r}")


@dataclass(frozen=True)
class _Worker:
    """The train handler's arguments, checked (``make_diloco_train_handler``)."""

    model_fn: ModelFn
    data_fn: DataFn
    loss_fn: LossFn
    train: TrainSettings
    run: Runtime
    payload: str
    seed: int
    key: str
    device: torch.device  # run.device resolved: the device this process trains on
    pace: Pace | None  # None: no emulated speed

    def model_key(self, context: Context, theta: Mapping[str, torch.Tensor]) -> tuple | None:
        """The model pool's key (:func:`~.worker_cache.borrow_model`; None: no pooling)."""
        code = getattr(self.model_fn, "__code__", self.model_fn)  # a lambda's: one per source
        run = self.run
        if (run.cache_nodes == 0 and not run.compile) or not isinstance(code, Hashable):
            return None
        sig = tuple((k, tuple(v.shape), v.dtype) for k, v in theta.items())
        return (
            context.run_id,
            code,
            sig,
            str(self.device),
            run.gradient_checkpointing,
            run.compile,
        )

    def build(self, context: Context):
        """``() -> (model on the device, forward, trainable named parameters)``."""

        def build():
            model = self.model_fn(context).to(self.device)
            named = _prepare_training(model, self.run.gradient_checkpointing)
            return model, (torch.compile(model) if self.run.compile else model), named

        return build


def _train_round(w: _Worker, c: _Round, theta, model, forward, named, context: Context):
    """Load ``theta``, run the round's H inner steps, write the node's state; the reply's
    content (everything in it fp32 on the CPU)."""
    names = set(theta)
    load_model_arrays(model, theta)
    model.train()
    if c.request is None and w.payload == "weights" and c.dp is None:
        theta = None  # a plain weights reply does not need theta: one model copy less
    opt = _adamw(named, c.lr, w.train.betas, c.wd, _use_fused_adamw(w.device))
    restore_moments(opt, named, context, w.device, w.run.cache_nodes)
    cursor = _data_cursor(context.state)
    node_seed = w.seed * 1_000_003 + int(context.node_config.get("partition-id", context.node_id))
    data = w.data_fn(context)
    torch.manual_seed(node_seed * 7919 + c.rnd)  # dropout etc., reproducible per round
    amp = Amp(w.device, w.run.precision, grad_scaler(w.device, w.run.precision))
    loop = InnerLoop(forward, opt, named, w.loss_fn, w.run.micro_batch, amp)
    pace = None if w.pace is None else replace(w.pace, overruns=0)  # this message's count
    t0 = time.perf_counter()
    losses, tokens, step_lr, cursor = _inner_steps(loop, data, cursor, node_seed, c, pace=pace)
    spent = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)  # freed before the state and reply are written (peak RSS)
    store_moments(opt, named, context, w.run.state_layout, w.device, w.run.cache_nodes)
    context.state[WORKER_STATE_KEY] = ConfigRecord({"data-cursor": cursor, "last-round": c.rnd})
    new = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in names}
    content = reply_content(theta, new, c.request, w.payload, context.state, w.key, c.dp)
    content["metrics"] = _train_metrics(tokens, losses, step_lr, c, amp, spent)
    if pace is not None:  # what the emulation did: the study checks its speeds held
        content["metrics"]["emulated-slowdown"] = pace.slowdown
        content["metrics"]["pace-overruns"] = pace.overruns
    return content


MOVED_KEYWORDS = {
    **{name: f"train=TrainSettings.{name}" for name in TRAIN_FIELDS},
    **{name: f"runtime=Runtime.{name}" for name in RUNTIME_FIELDS},
    "emulated_slowdown": "pace=Pace.slowdown",
    "emulated_step_s": "pace=Pace.step_s",
}
"""The keywords the train handler factories refuse (a ``TypeError``), naming the settings
field that took their place (:func:`~flwr_isoloco.settings_tools.renamed_fields`)."""


def _settings(train: object, runtime: object, payload: str, pace: object) -> None:
    """``TypeError`` for a settings argument of the wrong kind; ``ValueError`` for a payload
    that is neither ``"weights"`` nor ``"delta"``."""
    for name, value, kind in (("train", train, TrainSettings), ("runtime", runtime, Runtime)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {value!r}")
    if pace is not None and not isinstance(pace, Pace):
        raise TypeError(f"pace must be a Pace or None, got {pace!r}")
    _one_of("payload", payload, ("weights", "delta"))


@renamed_fields(**MOVED_KEYWORDS)
def make_diloco_train_handler(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    loss_fn: LossFn = next_token_loss,
    train: TrainSettings = TrainSettings(),  # noqa: B008 (frozen)
    runtime: Runtime = Runtime(),  # noqa: B008 (frozen)
    payload: str = "weights",
    seed: int = 0,
    arrayrecord_key: str = "arrays",
    configrecord_key: str = "config",
    pace: Pace | None = None,
) -> Callable[[Message, Context], Message]:
    """A ClientApp ``@app.train()`` handler running H inner AdamW steps (the repository's
    ``docs/strategies.md``, "The DiLoCo worker").

    ``model_fn(context) -> Module``: the model the received ``arrays`` load into
    (:func:`~flwr_isoloco.models.hf.load_model_arrays`: names, shapes and dtypes checked, a tied
    tensor received once and the tie kept; the reply has the message's names).
    ``data_fn(context)``: the node's batches, a sequence (a seeded order per epoch) or
    ``batch(step)``. ``loss_fn(model, batch) -> (mean loss, predicted tokens)``.

    ``train``: the inner loop's optimisation, the defaults of the message's config keys
    (:class:`~.worker_settings.TrainSettings`). ``runtime``: device, precision, memory and the
    per-process cache (:class:`~.worker_settings.Runtime`). ``payload``: reply ``theta_i``
    (``"weights"``, FedAvg-style) or ``theta - theta_i`` (``"delta"``). ``seed``, with the
    node's ``partition-id``, seeds the batch order and dropout. ``arrayrecord_key`` /
    ``configrecord_key``: the message's record names.

    ``pace`` (a study hook; None: off): a :class:`~.inner_loop.Pace` that pads every inner step
    with a sleep, so one machine emulates sites of unequal speed. It acts between a step and the
    time budget's next check, so the budget sees the padded steps as it would a slower machine;
    the reply adds ``emulated-slowdown`` and ``pace-overruns`` (counted per message).
    """
    _settings(train, runtime, payload, pace)
    w = _Worker(
        model_fn, data_fn, loss_fn, train, runtime, payload, seed, arrayrecord_key,
        resolve_node_device(runtime.device), pace if pace is not None and pace.active else None,
    )  # fmt: skip

    def train(msg: Message, context: Context) -> Message:  # the settings are w.train from here
        c = _round_settings(_config(msg, configrecord_key), w.train)
        theta = _received_arrays(msg, arrayrecord_key)
        pid = context.node_config.get("partition-id", "-")
        announce("DiLoCo worker", context, pid, w.device, w.run.precision, w.run.compile)
        with borrow_model(w.model_key(context, theta), w.build(context)) as (model, fwd, named):
            content = _train_round(w, c, theta, model, fwd, named, context)
        return Message(content, reply_to=msg)

    return train


def make_lm_evaluate_handler(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    loss_fn: LossFn = next_token_loss,
    max_batches: int | None = None,
    arrayrecord_key: str = "arrays",
    device: str | torch.device = "auto",
    precision: str = "fp32",
) -> Callable[[Message, Context], Message]:
    """A ClientApp ``@app.evaluate()`` handler: token-weighted validation loss of ``theta``.

    Replies ``num-examples`` (predicted tokens), ``eval-loss`` and ``eval-ppl = exp(eval-loss)``.
    ``data_fn(context)`` returns a sequence of validation batches. ``device`` and ``precision``
    as the train handler's :class:`~.worker_settings.Runtime` fields of those names (the forward
    under autocast; the loss is summed in fp64 on the CPU).
    """
    dev = resolve_node_device(device)
    precision = check_precision(precision)

    def evaluate(msg: Message, context: Context) -> Message:
        if arrayrecord_key not in msg.content.array_records:
            raise ValueError(f"evaluate message has no ArrayRecord {arrayrecord_key!r}")
        model = model_fn(context).to(dev)
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
                    batch = batch.to(dev)
                with autocast(dev, precision):
                    loss, n = loss_fn(model, batch)
                total += float(loss) * int(n)
                count += int(n)
        mean = total / count
        metrics = {"num-examples": count, "eval-loss": mean, "eval-ppl": math.exp(min(mean, 50.0))}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return evaluate
