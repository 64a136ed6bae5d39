"""The DiLoCo worker's settings (:func:`~flwr_isoloco.clients.make_diloco_train_handler`): two
frozen objects, each checked when built (``ValueError`` naming the field), shown by the fields
not at their default.

- ``train=TrainSettings(...)``: the inner loop's optimisation. Every field but ``betas`` is the
  default of the train message's config key of the same name with hyphens (``local_steps``:
  ``local-steps``), which the strategy's message overrides round by round.
- ``runtime=Runtime(...)``: where and how the loop runs (device, precision, compilation,
  memory) and how the node's AdamW state is kept between messages. Nothing here changes the
  step's arithmetic beyond rounding: the reply and the stored state are fp32 on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.settings_tools import short_repr

from .precision import check_compile, check_precision

__all__ = ["STATE_LAYOUTS", "Runtime", "TrainSettings", "message_key"]

STATE_LAYOUTS = ("flat", "named")
"""How the AdamW state is kept in ``context.state`` (:attr:`Runtime.state_layout`)."""


def message_key(name: str) -> str:
    """The train message's config key a :class:`TrainSettings` field is the default of."""
    return name.replace("_", "-")


def _number(where: str, value: object, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{where} must be in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _count(where: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {value!r}")
    return value


@short_repr
@dataclass(frozen=True)
class TrainSettings:
    """The inner loop's optimisation: H AdamW steps a round (eps 1e-8), the gradient norm
    clipped to ``clip_norm`` (0: off), the learning rate of global inner step
    ``s = (server-round - 1) H + h`` of ``T = num_server_rounds * H``::

        lr(s) = lr (s + 1) / W                                         s < W
        lr(s) = lr (r + (1 - r) (1 + cos(pi min((s - W) / (T - W), 1))) / 2)   otherwise

    with ``W = warmup_steps``, ``r = min_lr_ratio``, ``H = local_steps``
    (:func:`~flwr_isoloco.clients.inner_loop.inner_lr`). ``num_server_rounds`` None: the message
    must send ``num-server-rounds``.

    ``time_budget_s`` (0: off, every round runs H steps): seconds of inner steps a round; the
    node runs steps while ``t_n + t_n / n <= budget`` (``n`` steps so far took ``t_n``; at least
    1, at most H; :func:`~flwr_isoloco.clients.inner_loop.another_step_fits`), so a slow node
    runs fewer. The reply's ``num-examples`` counts the tokens of the steps run, so the server
    weighs the node by the work it did; it also reports ``inner-steps``, ``inner-steps-asked``
    (H), the budget and ``step-time-s``. Given the step count a round is deterministic; the
    count follows wall time. Refused under ``torch.distributed`` (each rank would time itself
    and the ranks could run different step counts).

    Each field but ``betas`` is the default of the message config key :func:`message_key` spells
    (``lr``, ``local-steps``, ``num-server-rounds``, ``warmup-steps``, ``min-lr-ratio``,
    ``weight-decay``, ``clip-norm``, ``time-budget-s``).
    """

    lr: float = 1.38e-3
    local_steps: int = 30
    num_server_rounds: int | None = None
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip_norm: float = 1.0
    time_budget_s: float = 0.0

    def __post_init__(self) -> None:
        _number("TrainSettings.lr", self.lr, 0.0)
        _count("TrainSettings.local_steps", self.local_steps, 1)
        if self.num_server_rounds is not None:
            _count("TrainSettings.num_server_rounds", self.num_server_rounds, 1)
        _count("TrainSettings.warmup_steps", self.warmup_steps, 0)
        _number("TrainSettings.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _number("TrainSettings.weight_decay", self.weight_decay, 0.0)
        _number("TrainSettings.clip_norm", self.clip_norm, 0.0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"TrainSettings.betas must be a pair (beta1, beta2), got {betas!r}")
        betas = tuple(_number("TrainSettings.betas", b, 0.0, 1.0) for b in betas)
        if max(betas) >= 1.0:
            raise ValueError(f"TrainSettings.betas must be in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        budget = _number("TrainSettings.time_budget_s (0 = off)", self.time_budget_s, 0.0)
        object.__setattr__(self, "time_budget_s", budget)


@short_repr
@dataclass(frozen=True)
class Runtime:
    """Where and how the inner loop runs.

    ``device``: ``"auto"`` (the GPU this process sees, in a Ray simulation the one assigned to
    the node's actor by ``options.backend.client-resources.num-gpus``; else the CPU),
    ``"cpu"``, ``"cuda"``, ``"cuda:<i>"`` or a ``torch.device``; a CUDA device that is not
    visible is refused when the handler is made, with the fix named
    (:func:`~flwr_isoloco.merging.device.resolve_node_device`).

    ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (:mod:`~flwr_isoloco.clients.precision`):
    the forward and the loss under autocast; weights, gradients and AdamW moments fp32, so the
    pseudo-gradient is fp32. fp16 scales the loss with a ``GradScaler`` made fresh for each
    message (its scale is not node state); the steps it skips are the reply's
    ``skipped-steps``. ``compile``: ``torch.compile`` the model once per process (kept in the
    process's model pool, :mod:`~flwr_isoloco.clients.worker_cache`).

    ``micro_batch``: each step's batch runs in pieces of this many rows with the gradient
    accumulated, ``grad L = sum_j grad(n_j L_j) / N`` (0: one piece; the same step to fp32
    rounding, at the activation memory of ``micro_batch`` rows). ``gradient_checkpointing``:
    recompute activations in the backward pass (``model.gradient_checkpointing_enable()``, a
    Hugging Face model's method).

    ``cache_nodes``: keep the model and the AdamW moments of the last ``cache_nodes`` nodes
    this process trained on the device between messages; a node's cached moments are used only
    while its stored record is the one this process wrote last (a token in it says so), so a hit
    is bitwise a read of the stored state, which is still written every message (0: build the
    model and read the moments every message). ``state_layout``: the AdamW state in
    ``context.state`` as ``"flat"`` (three arrays: every Flower ``Array`` costs an encode and a
    decode per message) or ``"named"`` (three per parameter); both are read.
    """

    device: str | torch.device = "auto"
    precision: str = "fp32"
    compile: bool = False
    micro_batch: int = 0
    gradient_checkpointing: bool = False
    cache_nodes: int = 1
    state_layout: str = "flat"

    def __post_init__(self) -> None:
        parse_device(self.device, "train.device")  # spelling; the handler resolves it
        object.__setattr__(self, "precision", check_precision(self.precision))
        check_compile(self.compile)
        _count("Runtime.micro_batch", self.micro_batch, 0)
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                "Runtime.gradient_checkpointing must be True or False, "
                f"got {self.gradient_checkpointing!r}"
            )
        _count("Runtime.cache_nodes", self.cache_nodes, 0)
        if self.state_layout not in STATE_LAYOUTS:
            raise ValueError(
                f"Runtime.state_layout must be 'flat' or 'named', got {self.state_layout!r}"
            )


TRAIN_FIELDS = tuple(f.name for f in fields(TrainSettings))
RUNTIME_FIELDS = tuple(f.name for f in fields(Runtime))
