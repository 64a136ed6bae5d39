"""peft LoRA client: K local AdamW steps on the node's private shard, adapter out.

:class:`LoRAClient` gives the train / evaluate / query handlers for two tasks, chosen by the
config's type: a sentence classifier (:class:`LoRAClientConfig`, :class:`SentenceTask`) and a
causal LM on text (:class:`~flwr_isoloco.clients.lora_causal.CausalLoRAClientConfig`, its
``CausalLMTask``). A task gives the model, the node's data, a batch's loss and the evaluation
metrics; the handlers, the batch stream and the optimiser state are shared. The node's data,
the message layout (``arrays``, ``config``, ``optimizer``, ``optimizer-config``, the reply
metrics) and the seeded batch order are specified in "The LoRA client" of the repository's ``docs/rwlora.md`` ("RW-LoRA and gossip LoRA").
The AdamW state travels through :mod:`flwr_isoloco.clients.adamw_state`.

Device and precision (both configs' ``device``, ``precision``, ``compile``): the node resolves
``device`` first (:func:`~flwr_isoloco.merging.device.resolve_node_device`: ``"auto"`` is the
GPU this process sees, in a Ray simulation the one assigned to the node's actor, else the CPU;
a CUDA device that is not visible is refused before the model or the data are loaded, the fix
named) and logs once which device it trains on. The cached model moves to the device; the
batches follow it. ``precision`` ``"bf16"`` / ``"fp16"`` runs the forward and loss under
autocast (:mod:`flwr_isoloco.clients.precision`) while the adapter, its gradients and the
AdamW moments stay fp32 (fp16 adds a gradient scaler); ``"fp32"`` is the plain loop. The
adapter travels as fp32 CPU tensors whatever the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from flwr_isoloco.clients.node_state import with_node_state
from flwr_isoloco.data import sentiment
from flwr_isoloco.merging.device import parse_device, resolve_node_device
from flwr_isoloco.models import classifier

from .adamw_state import adamw_to_arrays, arrays_to_adamw
from .precision import announce, autocast, check_compile, check_precision, grad_scaler

OPTIMIZER_KEY = "optimizer"
OPTIMIZER_CONFIG_KEY = "optimizer-config"
CARRY_KEY = "carry-optimizer-state"
STATE_KEY = "lora-client"


@dataclass(frozen=True)
class LoRAClientConfig:
    """Model, data and local-training settings of a node (all nodes must agree on ``lora``)."""

    lora: classifier.LoRASpec = field(default_factory=classifier.LoRASpec)
    data_source: str = sentiment.DEFAULT_SOURCE
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    test_size: int = 1000
    data_seed: int = 0
    max_examples: int = 0  # per shard, 0 = all
    val_fraction: float = 0.1
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    local_steps: int = 5
    max_length: int = 64
    num_threads: int = 0  # torch threads per client process (0 = leave as is)
    partition_key: str = "partition-id"
    num_partitions_key: str = "num-partitions"
    data_path_key: str = "data-path"  # node-config key of the site's own file ("" = none)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:<index>" (module docstring)
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16": autocast, fp32 adapter and moments
    compile: bool = False  # torch.compile the training forward, once per process

    def __post_init__(self):
        check_train_options(self)
        for name in ("batch_size", "local_steps", "max_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")

    @property
    def task(self) -> SentenceTask:
        return SENTENCE_TASK


@dataclass
class NodeData:
    """A node's training rows and validation rows (texts, labels)."""

    train_texts: list[str]
    train_labels: list[int]
    val_texts: list[str]
    val_labels: list[int]


def node_partition(context: Context, cfg: LoRAClientConfig) -> tuple[int, int]:
    """(partition id, number of partitions) from ``context.node_config``, checked."""
    nc = context.node_config
    if cfg.partition_key not in nc:
        raise KeyError(f"node_config has no {cfg.partition_key!r} (got keys {sorted(nc)})")
    pid = int(nc[cfg.partition_key])
    n = int(nc.get(cfg.num_partitions_key, 0))
    if n <= 0:
        raise KeyError(f"node_config needs a positive {cfg.num_partitions_key!r} (got {n})")
    if not 0 <= pid < n:
        raise ValueError(f"node_config {cfg.partition_key}={pid} not in [0, {n})")
    return pid, n


def node_data_path(context: Context, cfg: LoRAClientConfig) -> str:
    """The site's own data file (node-config ``data-path``), or "" to use its partition."""
    if not cfg.data_path_key:
        return ""
    value = context.node_config.get(cfg.data_path_key, "")
    return "" if value is None else str(value)


def load_node_data(cfg: LoRAClientConfig, pid: int, n: int, data_path: str = "") -> NodeData:
    """The node's rows, split into training rows and a validation tail.

    Without ``data_path``: the shard of partition ``pid``. With it: the site's own file
    (:func:`sentiment.load_local_sentences`), shuffled once with ``cfg.data_seed`` so that the
    validation tail does not depend on the file's row order, then capped at ``max_examples``.
    """
    if data_path:
        shard = sentiment.load_local_sentences(data_path)
        shard = shard.select(np.random.default_rng(cfg.data_seed).permutation(len(shard)))
        if cfg.max_examples and len(shard) > cfg.max_examples:
            shard = shard.select(range(cfg.max_examples))
        what = f"data path {data_path!r}"
    else:
        shard = sentiment.load_partition(
            pid,
            n,
            cfg.data_source,
            cfg.partitioner,
            cfg.dirichlet_alpha,
            cfg.test_size,
            cfg.data_seed,
            cfg.max_examples,
        )
        what = f"partition {pid}"
    texts, labels = list(shard["text"]), [int(y) for y in shard["label"]]
    n_val = int(len(texts) * cfg.val_fraction)
    if len(texts) - n_val < 1:
        raise ValueError(f"{what} has {len(texts)} rows: too few to train on")
    cut = len(texts) - n_val
    return NodeData(texts[:cut], labels[:cut], texts[cut:], labels[cut:])


def batch_indices(cursor: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Rows of the batch starting at stream position ``cursor``.

    The stream is the concatenation of epoch permutations ``perm_e = rng(seed, e).permutation(n)``.
    """
    out = np.empty(batch_size, dtype=np.int64)
    for j in range(batch_size):
        pos = cursor + j
        epoch, offset = divmod(pos, n)
        perm = _epoch_perm(seed, epoch, n)
        out[j] = perm[offset]
    return out


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_perm(seed: int, epoch: int, n: int) -> np.ndarray:
    key = (seed, epoch, n)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 256:
            _PERM_CACHE.clear()
        _PERM_CACHE[key] = np.random.default_rng([seed, epoch]).permutation(n)
    return _PERM_CACHE[key]


def _trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def check_train_options(cfg: Any) -> None:
    """``ValueError`` naming ``device`` (spelling only: the node resolves it), ``precision`` or
    ``compile`` of a client config when out of its choices."""
    parse_device(cfg.device, what="device")
    check_precision(cfg.precision, what="precision")
    check_compile(cfg.compile)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (its inputs go there)."""
    return next(model.parameters()).device


_COMPILED: dict[int, tuple[torch.nn.Module, Any]] = {}


def compiled_forward(model: torch.nn.Module) -> Any:
    """``torch.compile(model)``, made once per model object in this process (the cached
    models live as long as the process, so each compiles once) and reused by every message."""
    hit = _COMPILED.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_COMPILED) >= 4:
            _COMPILED.clear()
        hit = _COMPILED[id(model)] = (model, torch.compile(model))
    return hit[1]


class _OnDevice:
    """``model`` as :func:`classifier.evaluate` uses it (CPU inputs, ``.logits`` read against
    CPU labels) when the model is on another device: inputs go to the device, fp32 logits
    come back to the CPU."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self) -> _OnDevice:
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> _OnDevice:
        self.model.train(mode)
        return self

    def __call__(self, **batch: torch.Tensor) -> SimpleNamespace:
        out = self.model(**{k: v.to(self.device) for k, v in batch.items()})
        return SimpleNamespace(logits=out.logits.float().cpu())


class SentenceTask:
    """The sentence-classifier task: cross-entropy on labels, loss and accuracy."""

    name = "sequence-classification"

    def model(self, cfg: LoRAClientConfig):
        return classifier.get_model(cfg.lora)

    def tokenizer(self, cfg: LoRAClientConfig):
        return classifier.load_tokenizer(cfg.lora.model)

    def node_data(self, cfg: LoRAClientConfig, pid: int, n: int, data_path: str = ""):
        return load_node_data(cfg, pid, n, data_path)

    def num_train(self, data: NodeData) -> int:
        return len(data.train_texts)

    def batch_loss(self, model, tokenizer, data: NodeData, idx, cfg, device=None) -> torch.Tensor:
        """Mean cross-entropy of rows ``idx``; the batch goes to ``device`` (None: the CPU)."""
        batch = classifier.encode(tokenizer, [data.train_texts[i] for i in idx], cfg.max_length)
        y = torch.tensor([data.train_labels[i] for i in idx])
        if device is not None and device.type != "cpu":
            batch, y = {k: v.to(device) for k, v in batch.items()}, y.to(device)
        return torch.nn.functional.cross_entropy(model(**batch).logits.float(), y)

    def evaluate(self, model, tokenizer, data: NodeData, cfg) -> dict[str, float]:
        texts, labels = data.val_texts, data.val_labels
        if not texts:  # no validation slice: fall back to the training rows
            texts, labels = data.train_texts, data.train_labels
        dev = model_device(model)
        view = model if dev.type == "cpu" else _OnDevice(model, dev)
        with autocast(dev, cfg.precision):
            res = classifier.evaluate(view, tokenizer, texts, labels, max_length=cfg.max_length)
        return {"num-examples": len(texts), "eval_loss": res["loss"], "eval_acc": res["accuracy"]}


SENTENCE_TASK = SentenceTask()


def train_steps(
    model,
    tokenizer,
    data,
    cfg,
    *,
    steps: int,
    lr: float,
    cursor: int,
    seed: int,
    opt_state: tuple[Mapping[str, torch.Tensor], int] | None = None,
    forward: Any = None,
) -> tuple[float, int, tuple[dict[str, torch.Tensor], int]]:
    """``steps`` AdamW steps from stream position ``cursor`` (fresh AdamW unless ``opt_state``
    = (moments, step) is given) on ``cfg.task``'s loss; returns (mean loss, new cursor,
    (moments, step)).

    On ``model``'s device, the loss under ``cfg.precision``'s autocast (fp16: through a
    gradient scaler, a step with an inf/NaN gradient skipped); ``forward`` (default ``model``)
    is what computes it, e.g. its ``torch.compile`` wrapper."""
    task = cfg.task
    named = _trainable(model)
    opt = torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=cfg.weight_decay)
    if opt_state is not None:
        arrays_to_adamw(opt, named, *opt_state)
    n = task.num_train(data)
    device = model_device(model)
    scaler = grad_scaler(device, cfg.precision)
    forward = model if forward is None else forward
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]):
        for _ in range(steps):
            idx = batch_indices(cursor, cfg.batch_size, n, seed)
            torch.manual_seed(int(np.random.default_rng([seed, cursor]).integers(2**62)))
            with autocast(device, cfg.precision):
                loss = task.batch_loss(forward, tokenizer, data, idx, cfg, device)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            cursor += cfg.batch_size
    model.eval()
    return (
        float(np.mean(losses)) if losses else float("nan"),
        cursor,
        adamw_to_arrays(opt, named),
    )


class LoRAClient:
    """ClientApp handlers (train / evaluate / query) for a peft LoRA model.

    ``config`` is a :class:`LoRAClientConfig` (sentence classifier), a
    :class:`~flwr_isoloco.clients.lora_causal.CausalLoRAClientConfig` (causal LM), or a
    function ``context -> config`` (e.g. built from ``context.run_config``).
    """

    def __init__(
        self,
        config: LoRAClientConfig | Callable[[Context], LoRAClientConfig] | None = None,
        *,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        optimizer_key: str = OPTIMIZER_KEY,
        optimizer_config_key: str = OPTIMIZER_CONFIG_KEY,
    ) -> None:
        self._config = config or LoRAClientConfig()
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.optimizer_key = optimizer_key
        self.optimizer_config_key = optimizer_config_key

    # ------------------------------------------------------------------ helpers
    def config(self, context: Context):
        cfg = self._config(context) if callable(self._config) else self._config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        return cfg

    def _setup(self, msg: Message, context: Context):
        cfg = self.config(context)
        device = resolve_node_device(cfg.device, what="device")  # before anything is loaded
        pid, n = node_partition(context, cfg)
        pid = context.node_config.get(cfg.partition_key, "-")
        announce(f"LoRA client ({cfg.task.name})", context, pid, device, cfg.precision, cfg.compile)
        model = cfg.task.model(cfg).to(device)  # the cached model: moved once
        if self.arrayrecord_key not in msg.content.array_records:
            raise KeyError(f"message has no ArrayRecord {self.arrayrecord_key!r}")
        adapter = msg.content.array_records[self.arrayrecord_key].to_torch_state_dict()
        classifier.load_adapter_state_dict(model, adapter)
        return cfg, pid, n, model

    def _msg_config(self, msg: Message) -> Mapping:
        rec = msg.content.config_records.get(self.configrecord_key)
        return rec if rec is not None else {}

    # ------------------------------------------------------------------ handlers
    def train(self, msg: Message, context: Context) -> Message:
        cfg, pid, n, model = self._setup(msg, context)
        mc = self._msg_config(msg)
        steps = int(mc.get("local-steps", cfg.local_steps))
        lr = float(mc.get("lr", cfg.lr))
        if steps < 1 or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"bad message config: local-steps={steps}, lr={lr}")
        carry = bool(mc.get(CARRY_KEY, False)) or self.optimizer_key in msg.content
        opt_state = None
        if self.optimizer_key in msg.content.array_records:
            oc = msg.content.config_records.get(self.optimizer_config_key)
            opt_state = (
                msg.content.array_records[self.optimizer_key].to_torch_state_dict(),
                int(oc["step"]) if oc is not None and "step" in oc else 0,
            )
        data = cfg.task.node_data(cfg, pid, n, node_data_path(context, cfg))
        cursor = _get_cursor(context)
        seed = _node_seed(cfg, pid)
        loss, cursor, new_opt = train_steps(
            model,
            cfg.task.tokenizer(cfg),
            data,
            cfg,
            steps=steps,
            lr=lr,
            cursor=cursor,
            seed=seed,
            opt_state=opt_state,
            forward=compiled_forward(model) if cfg.compile else None,
        )
        _set_cursor(context, cursor)
        content = RecordDict(
            {
                self.arrayrecord_key: ArrayRecord(classifier.adapter_state_dict(model)),
                "metrics": MetricRecord(
                    {
                        "num-examples": cfg.task.num_train(data),
                        "train_loss": loss,
                        "local-steps": steps,
                        "examples-seen": steps * cfg.batch_size,
                        "partition-id": pid,
                        "data-cursor": cursor,
                    }
                ),
            }
        )
        if carry:
            content[self.optimizer_key] = ArrayRecord(new_opt[0])
            content[self.optimizer_config_key] = ConfigRecord({"step": new_opt[1]})
        return Message(content=content, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        cfg, pid, n, model = self._setup(msg, context)
        data = cfg.task.node_data(cfg, pid, n, node_data_path(context, cfg))
        metrics = MetricRecord(cfg.task.evaluate(model, cfg.task.tokenizer(cfg), data, cfg))
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    def query(self, msg: Message, context: Context) -> Message:
        cfg = self.config(context)
        key = str(self._msg_config(msg).get("vertex-key", cfg.partition_key))
        if key not in context.node_config:
            raise KeyError(f"node_config has no {key!r} (got keys {sorted(context.node_config)})")
        value = context.node_config[key]
        metrics: dict[str, int] = {}
        if key == cfg.partition_key:
            pid, n = node_partition(context, cfg)
            metrics = {cfg.partition_key: pid, cfg.num_partitions_key: n}
            try:
                data = cfg.task.node_data(cfg, pid, n, node_data_path(context, cfg))
                metrics["num-examples"] = cfg.task.num_train(data)
            except (ValueError, FileNotFoundError):
                pass  # still answer who we are; training will report the data problem
        content = RecordDict({"config": ConfigRecord({key: value})})
        if metrics:
            content["metrics"] = MetricRecord(metrics)
        return Message(content=content, reply_to=msg)

    def register(self, app) -> None:
        """Attach the three handlers to a ``flwr.clientapp.ClientApp``; train keeps the node's
        state in node-state files when the server asks (:func:`with_node_state`)."""
        app.train()(with_node_state(self.train, config_key=self.configrecord_key))
        app.evaluate()(self.evaluate)
        app.query()(self.query)


def _node_seed(cfg: LoRAClientConfig, pid: int) -> int:
    return int(np.random.default_rng([cfg.lora.seed, pid, 7919]).integers(2**31))


def _get_cursor(context: Context) -> int:
    """Stream position kept in ``context.state`` (restored from the node-state file after a
    resume, :mod:`~flwr_isoloco.clients.node_state`), else 0."""
    rec = context.state.config_records.get(STATE_KEY)
    if rec is not None and "cursor" in rec:
        return int(rec["cursor"])
    return 0


def _set_cursor(context: Context, cursor: int) -> None:
    context.state[STATE_KEY] = ConfigRecord({"cursor": int(cursor)})


def with_overrides(cfg: LoRAClientConfig, **kw) -> LoRAClientConfig:
    """Copy of ``cfg`` with fields replaced (``lora_<field>`` replaces inside ``cfg.lora``)."""
    lora_kw = {k[5:]: v for k, v in kw.items() if k.startswith("lora_")}
    rest = {k: v for k, v in kw.items() if not k.startswith("lora_")}
    return replace(cfg, lora=replace(cfg.lora, **lora_kw), **rest)
