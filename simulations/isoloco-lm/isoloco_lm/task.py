"""Shared pieces of the isoloco-lm app: run-config schema, model, data, strategy.

Kept free of ServerApp/ClientApp objects so tests can drive them in-process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from flwr_isoloco.clients.hf_lm import batch_generator as batch_generator  # re-exported
from flwr_isoloco.clients.precision import PRECISIONS
from flwr_isoloco.data.text import shard_tokens
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.models.llama import build_llama, llama_config
from flwr_isoloco.runconfig import (
    SEED_MAX,
    THREADS_MAX,
    RunConfigError,
    absolute_path,
    choices,
    existing_path,
    in_range,
    non_negative,
    positive,
    read_run_config,
)
from flwr_isoloco.strategies.diloco.config import (
    DILOCO_RUN_CONFIG,
    ISOLOCO_RUN_CONFIG,
    RUN_CONFIG_CHECKS,
    node_view,
    refuse_renamed_keys,
)
from flwr_isoloco.strategies.diloco.presets import ISOLOCO_PRESETS

from . import pretrained

# a node's own text (node-config data-path): defined in node_data, re-exported here
from .node_data import DATA_PATH_KEY as DATA_PATH_KEY
from .node_data import NodeDataError as NodeDataError
from .node_data import local_batches as local_batches
from .node_data import local_tokens as local_tokens
from .node_data import window_batches

# the run's text, tokenizer and cache folder: defined in run_text, re-exported here
from .run_text import cache_dir as cache_dir
from .run_text import cache_path as _cache
from .run_text import text_data as text_data
from .tuned import OuterValues, outer_values

STRATEGIES = ("isoloco", "diloco", "fedavg")
LM_ISOLOCO_PRESET = ISOLOCO_PRESETS["isoloco-paper"]
"""The app's IsoLoCo is the paper's update (tuned for this kind of LM: lm_tuning.json), not the
library's drop-in default."""
STRATEGY_CLASS_DEFAULTS = {
    "isoloco": {
        **ISOLOCO_RUN_CONFIG,
        "preset": LM_ISOLOCO_PRESET.name,
        "merge": LM_ISOLOCO_PRESET.merge,
        "outer-lr": LM_ISOLOCO_PRESET.outer_lr,
        "outer-momentum": LM_ISOLOCO_PRESET.outer_momentum,
    },
    "diloco": DILOCO_RUN_CONFIG,
}

# The strategy section: the app's own keys, then the DiLoCo/IsoLoCo keys that mean something
# here, with the strategy's own defaults (flwr_isoloco.strategies.diloco.config, written once).
# -1 / "" = "the chosen strategy's default" (min-train-/min-available-nodes: strategy.min-nodes).
APP_STRATEGY_KEYS: dict[str, Any] = {
    "name": "isoloco",
    "merge": "",
    "outer-lr": -1.0,
    "outer-momentum": -1.0,
    "fast": False,
    "min-nodes": 2,
    "min-train-nodes": -1,
    "min-available-nodes": -1,
    # Secure aggregation (flwr_isoloco.strategies.diloco.secagg): the train rounds under SecAgg+.
    # num-shares / reconstruction-threshold: <= 1 a fraction, > 1 a count; max-weight 0 = the
    # default (1 with uniform weighting, else local-steps x batch-size x seq-len tokens).
    "secagg": False,
    "secagg-num-shares": 1.0,
    "secagg-reconstruction-threshold": 0.67,
    "secagg-clipping-range": 8.0,
    "secagg-quantization-range": 1 << 22,
    "secagg-max-weight": 0.0,
}
NOT_IN_APP = {
    "fraction-evaluate": "the app evaluates server-side only",
    "min-evaluate-nodes": "the app evaluates server-side only",
    "seed": "the app's top-level seed seeds the strategy",
    "preset": "the app's IsoLoCo is the paper's update (its tuned values); choose the rule and "
    "step with strategy.merge / strategy.outer-lr / strategy.outer-momentum",
}
_OPTION_KEYS = ("prune-fraction", "drop-rate", "common-fraction", "ns-steps", "spectral-pattern")
_DP_KEYS = (
    "dp-noise-multiplier",
    "dp-clipping-norm",
    "dp-max-epsilon",
    "dp-mode",
    "dp-adaptive-quantile",
    "dp-clip-lr",
    "dp-clip-count-std",
)
STRATEGY_SECTION: dict[str, Any] = {
    **APP_STRATEGY_KEYS,
    **{k: v for k, v in DILOCO_RUN_CONFIG.items() if k not in {**APP_STRATEGY_KEYS, **NOT_IN_APP}},
}

# The schema: every run-config key with its default (mirrors [tool.flwr.app.config]; a test
# checks they agree). -1 / "" = "the chosen strategy's default".
DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 10,
    "rounds-this-run": 0,
    "seed": 0,
    "output-dir": "",
    "resume-from": "",
    "round-timeout": 600.0,
    "checkpoint": True,
    "torch-threads": 1,
    "strategy": STRATEGY_SECTION,
    "train": {
        "local-steps": 20,
        "lr": 3e-3,
        "warmup-steps": 20,
        "min-lr-ratio": 0.1,
        "weight-decay": 0.1,
        "clip-norm": 1.0,
        "batch-size": 8,
        "seq-len": 128,
        "micro-batch": 0,
        "gradient-checkpointing": False,
        "device": "auto",
        "precision": "fp32",
        "compile": False,
        "time-budget-s": 0.0,
        "slowdown-spread": 1.0,
        "emulated-step-s": 0.0,
    },
    "model": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv-heads": 0,
        "intermediate": 0,
        "vocab-size": 2048,
        "name-or-path": "",
        "gguf-file": "",
        "tokenizer": "",
        "dtype": "float32",
    },
    "data": {
        "corpus": "shakespeare",
        "val-fraction": 0.05,
        "val-tokens": 16384,
        "cache-dir": "",
    },
}


def _merge_name(value: str) -> None:
    if value != "" and value not in MERGE_RULES:
        raise ValueError(f"unknown merge rule; expected '' or one of {sorted(MERGE_RULES)}")


def _default_or_positive(value: float) -> None:
    if value != -1.0 and not value > 0:
        raise ValueError("must be > 0, or -1 for the strategy's default")


def _default_or_non_negative(value: float) -> None:
    if value != -1.0 and not value >= 0:
        raise ValueError("must be >= 0, or -1 for the strategy's default")


def _corpus(value: str) -> None:
    if not value:
        raise ValueError("must name a corpus ('shakespeare', a path, or a Hub data set)")
    if os.path.isabs(os.path.expanduser(value)) and not os.path.exists(os.path.expanduser(value)):
        raise ValueError("no such file or directory")


VALIDATORS = {
    "num-server-rounds": positive,
    "rounds-this-run": non_negative,
    "seed": in_range(0, SEED_MAX),
    "output-dir": absolute_path(allow_empty=True),
    "resume-from": [absolute_path(allow_empty=True), existing_path(allow_empty=True)],
    "round-timeout": positive,
    "torch-threads": in_range(1, THREADS_MAX),
    # the strategy's own checks for its keys, then the app's (stricter or sentinel) ones
    **{f"strategy.{k}": v for k, v in RUN_CONFIG_CHECKS.items() if k in STRATEGY_SECTION},
    "strategy.name": choices(*STRATEGIES),
    "strategy.merge": _merge_name,
    "strategy.outer-lr": _default_or_positive,
    "strategy.outer-momentum": _default_or_non_negative,
    "strategy.min-nodes": positive,
    "strategy.min-train-nodes": _default_or_non_negative,
    "strategy.min-available-nodes": _default_or_non_negative,
    "strategy.fraction-train": in_range(0.0, 1.0, lo_open=True),
    "strategy.secagg-num-shares": positive,
    "strategy.secagg-reconstruction-threshold": positive,
    "strategy.secagg-clipping-range": positive,
    "strategy.secagg-quantization-range": in_range(2, 1 << 31),
    "strategy.secagg-max-weight": non_negative,
    "train.local-steps": positive,
    "train.lr": positive,
    "train.warmup-steps": non_negative,
    "train.min-lr-ratio": in_range(0.0, 1.0),
    "train.weight-decay": non_negative,
    "train.clip-norm": non_negative,
    "train.batch-size": positive,
    "train.seq-len": positive,
    "train.micro-batch": non_negative,
    # spelling only: each node resolves it on its own machine (client_app.py)
    "train.device": functools.partial(parse_device, what="train.device"),
    "train.precision": choices(*PRECISIONS),
    "train.time-budget-s": non_negative,
    "train.slowdown-spread": in_range(1.0, 1000.0),
    "train.emulated-step-s": non_negative,
    "model.hidden": positive,
    "model.layers": positive,
    "model.heads": positive,
    "model.kv-heads": non_negative,
    "model.intermediate": non_negative,
    "model.vocab-size": in_range(300, 65535),
    "model.name-or-path": pretrained.name_or_path,
    "model.dtype": choices("float32", "bfloat16", "float16"),
    "data.corpus": _corpus,
    "data.val-fraction": in_range(0.0, 0.5, lo_open=True),
    "data.val-tokens": positive,
    "data.cache-dir": absolute_path(allow_empty=True),
}


def load_config(run_config: Mapping[str, Any], *, node: bool = False) -> DictConfig:
    """Validated app config (raises :class:`RunConfigError` naming the bad key).

    ``node=True`` (a ClientApp): the server's own settings (``strategy.merge-device``) are
    checked for spelling only, not resolved on the node's machine (:func:`node_view`).
    """
    refuse_renamed_keys(run_config)
    for key, why in NOT_IN_APP.items():
        if f"strategy.{key}" in run_config:
            raise RunConfigError(f"run-config key 'strategy.{key}' has no meaning here: {why}")
    cfg = read_run_config(run_config, DEFAULTS, VALIDATORS)
    s = cfg.strategy
    if s.name == "fedavg":
        for key, unset in (("merge", ""), ("outer-lr", -1.0), ("outer-momentum", -1.0)):
            if s[key] != unset and not (key == "merge" and s[key] == "mean"):
                raise RunConfigError(
                    f"run-config key 'strategy.{key}' = {s[key]!r} conflicts with strategy.name "
                    "'fedavg' (FedAvg is mean merge, outer lr 1, no momentum); use 'diloco'"
                )
    t, steps = cfg.train, cfg["num-server-rounds"] * cfg.train["local-steps"]
    if t["warmup-steps"] > steps:
        raise RunConfigError(
            f"run-config key 'train.warmup-steps' = {t['warmup-steps']} is longer than the run "
            f"({cfg['num-server-rounds']} rounds x {t['local-steps']} local steps = {steps})"
        )
    if s.fast and s.name != "isoloco":
        raise RunConfigError(
            f"run-config key 'strategy.fast' = true needs strategy.name 'isoloco', got {s.name!r}"
        )
    if s.fast and s.merge not in ("", "iso_c", "iso_c_ns"):
        raise RunConfigError(
            f"run-config key 'strategy.fast' = true conflicts with strategy.merge {s.merge!r}"
        )
    try:  # merge options (prune-fraction, drop-rate, ...) are checked by the merge rule
        build_strategy(cfg, node=node)
    except ValueError as exc:
        if str(exc).startswith("strategy.merge-device"):  # the server's device (config.py)
            raise RunConfigError(f"run-config key {exc}") from None
        if s.secagg and ("secure aggregation" in str(exc) or "secagg" in str(exc).lower()):
            raise RunConfigError(f"run-config key 'strategy.secagg' = true: {exc}") from None
        named = (*_OPTION_KEYS, *_DP_KEYS)
        said = str(exc)  # names a key, its argument or its settings field (clipping_norm)
        field = {k: k.removeprefix("dp-").replace("-", "_") for k in named}
        spelt = {
            k: (k, k.replace("-", "_"), *([field[k]] if "_" in field[k] else [])) for k in named
        }
        opts = [k for k in named if any(w in said for w in spelt[k])] or ["merge"]
        raise RunConfigError(
            f"run-config key 'strategy.{opts[0]}' (strategy.merge {s.merge or 'default'!r}): {exc}"
        ) from None
    pretrained.check_keys(cfg, DEFAULTS["model"])
    if pretrained.is_pretrained(cfg):
        return cfg
    try:
        llama_config(**model_kwargs(cfg))
    except ValueError as exc:
        raise RunConfigError(f"run-config 'model.*' keys are inconsistent: {exc}") from None
    return cfg


def model_kwargs(cfg: DictConfig) -> dict[str, Any]:
    m = cfg.model
    return {
        "vocab_size": m["vocab-size"],
        "hidden": m.hidden,
        "layers": m.layers,
        "heads": m.heads,
        "kv_heads": m["kv-heads"],
        "intermediate": m.intermediate,
        "max_seq_len": cfg.train["seq-len"],
    }


# ----------------------------------------------------------------------------- model and data
def build_model(cfg: DictConfig, init: bool = True) -> torch.nn.Module:
    """The built-in LLaMA of the ``model.*`` sizes, or the pretrained ``model.name-or-path``;
    ``init=False``: the built-in LLaMA's weights are not drawn (for a worker, which loads every
    weight from the server's message next; :func:`~flwr_isoloco.models.llama.build_llama`)."""
    if pretrained.is_pretrained(cfg):
        return pretrained.build(cfg, _cache(cfg))
    return build_llama(llama_config(**model_kwargs(cfg)), seed=cfg.seed, init=init)


def check_seq_len(cfg: DictConfig) -> None:
    """``train.seq-len`` must fit the pretrained model's ``max_position_embeddings``."""
    if not pretrained.is_pretrained(cfg):
        return
    most = pretrained.max_positions(cfg, _cache(cfg))
    if most is not None and cfg.train["seq-len"] > most:
        raise RunConfigError(
            f"run-config key 'train.seq-len' = {cfg.train['seq-len']} is longer than the "
            f"model's maximum ({most} positions)"
        )


def node_batches(cfg: DictConfig, partition_id: int, num_partitions: int):
    """``batch(i)``: the node's i-th training batch, random windows of its contiguous shard,
    seeded by (seed, partition, i) so a resumed node draws exactly the same batches."""
    return window_batches(
        cfg, shard_tokens(text_data(cfg).train, partition_id, num_partitions), partition_id
    )


def validation_batches(cfg: DictConfig) -> list[torch.Tensor]:
    from flwr_isoloco.data.text import eval_batches

    data, seq = text_data(cfg), cfg.train["seq-len"]
    rows = 16
    if pretrained.is_pretrained(cfg):  # logits are rows x seq x vocab floats: keep them ~128 MB
        rows = max(1, min(16, 2**25 // (seq * data.vocab_size)))
    return list(eval_batches(data.val, rows, seq, cfg.data["val-tokens"]))


def evaluate_model(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Token-weighted mean next-token cross-entropy over ``batches``, in fp32 on the model's
    device (the batches go there)."""
    from flwr_isoloco.clients.diloco_worker import next_token_loss

    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            loss, n = next_token_loss(model, b.to(device))
            total += float(loss) * n
            count += n
    return total / count


# ----------------------------------------------------------------------------- strategy
def build_strategy(cfg: DictConfig, *, node: bool = False):
    """DiLoCo / IsoLoCo / FedAvg (= DiLoCo(mean, lr 1, momentum 0)) from the validated app
    config (no second validation: :meth:`DiLoCo.from_section`); server-side evaluation only.
    ``node=True``: the check a node makes, without the server's own settings (:func:`node_view`)."""
    from flwr_isoloco.strategies import DiLoCo, IsoLoCo

    s = cfg.strategy
    section = {k: s[k] for k in STRATEGY_SECTION if k not in APP_STRATEGY_KEYS}
    if node:
        section = node_view(section)
    for key in ("min-train-nodes", "min-available-nodes"):
        section[key] = s["min-nodes"] if s[key] == -1 else s[key]
    section.update({"fraction-evaluate": 0.0, "min-evaluate-nodes": 0, "seed": cfg.seed})
    if s.name == "fedavg":
        section.update({"merge": "mean", "outer-lr": 1.0, "outer-momentum": 0.0})
        return DiLoCo.from_section(section)
    cls = IsoLoCo if s.name == "isoloco" else DiLoCo
    section["merge"] = strategy_merge(cfg)
    outer = strategy_outer(cfg)
    section.update({"outer-lr": outer.outer_lr, "outer-momentum": outer.outer_momentum})
    if s.name == "isoloco":
        section["preset"] = LM_ISOLOCO_PRESET.name
        if s.fast:
            section["fast"] = True
    return with_secagg(cfg, cls.from_section(section))


def _fraction_or_count(v: float) -> float | int:
    return float(v) if v <= 1 else int(v)


def with_secagg(cfg: DictConfig, strategy: Any) -> Any:
    """``strategy`` run under SecAgg+ when ``strategy.secagg`` (``ValueError`` naming what it
    cannot serve), else unchanged."""
    s = cfg.strategy
    if not s.secagg:
        return strategy
    from flwr_isoloco.strategies.diloco.secagg import use_secagg

    t = cfg.train
    tokens = t["local-steps"] * t["batch-size"] * t["seq-len"]  # one round's num-examples
    weight = s["secagg-max-weight"] or (1.0 if s.weighting == "uniform" else float(tokens))
    return use_secagg(
        strategy,
        num_shares=_fraction_or_count(s["secagg-num-shares"]),
        reconstruction_threshold=_fraction_or_count(s["secagg-reconstruction-threshold"]),
        clipping_range=float(s["secagg-clipping-range"]),
        quantization_range=int(s["secagg-quantization-range"]),
        max_weight=weight,
    )


def strategy_merge(cfg: DictConfig) -> str:
    """The merge rule in force: ``strategy.merge``, else the strategy's own (``fast``: Iso-C NS)."""
    s = cfg.strategy
    if s.name == "fedavg":
        return "mean"
    if s.name == "isoloco" and s.fast:  # load_config refused any other strategy.merge
        return "iso_c_ns"
    if s.merge:
        return s.merge
    return STRATEGY_CLASS_DEFAULTS[s.name]["merge"]


def strategy_outer(cfg: DictConfig) -> OuterValues:
    """Outer lr / momentum in force and where they came from: the run config's, else the merge
    rule's tuned values (:mod:`.tuned`), else the strategy class's; FedAvg is lr 1, mu 0."""
    s = cfg.strategy
    if s.name == "fedavg":
        return OuterValues(1.0, 0.0, "outer lr 1.0, momentum 0.0 (FedAvg)")
    name = {"isoloco": "IsoLoCo", "diloco": "DiLoCo"}[s.name]
    return outer_values(
        strategy_merge(cfg),
        s["outer-lr"],
        s["outer-momentum"],
        STRATEGY_CLASS_DEFAULTS[s.name],
        name,
    )


def train_config(cfg: DictConfig) -> dict[str, Any]:
    """What the server sends to workers (the DiLoCo worker's message config keys)."""
    t = cfg.train
    return {
        "num-server-rounds": cfg["num-server-rounds"],
        "local-steps": t["local-steps"],
        "lr": t.lr,
        "warmup-steps": t["warmup-steps"],
        "min-lr-ratio": t["min-lr-ratio"],
        "weight-decay": t["weight-decay"],
        "clip-norm": t["clip-norm"],
    }
