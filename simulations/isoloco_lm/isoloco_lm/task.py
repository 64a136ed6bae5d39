"""Shared pieces of the isoloco-lm app: run-config schema, model, data, strategy, node state.

Kept free of ServerApp/ClientApp objects so tests can drive them in-process.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from flwr_isoloco.checkpoint import (
    RECORDS_FIELD,
    Field,
    checkpoint_error,
    load_checkpoint,
    recorddict_to_tree,
    restoring,
    save_checkpoint,
    tree_to_recorddict,
)
from flwr_isoloco.data.text import load_corpus, prepare_tokens, sample_batch, shard_tokens
from flwr_isoloco.merging import MERGE_RULES
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

STRATEGIES = ("isoloco", "diloco", "fedavg")

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
    "strategy": {
        "name": "isoloco",
        "merge": "",
        "outer-lr": -1.0,
        "outer-momentum": -1.0,
        "nesterov": True,
        "fast": False,
        "orthogonalize": "gradient",
        "min-nodes": 2,
        "fraction-train": 1.0,
        "max-update-norm": 0.0,
        "max-norm-ratio": 0.0,
        "max-weight-ratio": 5.0,
        "max-empty-rounds": 3,
        "upload-codec": "none",
        "codec-block-size": 256,
        "codec-fraction": 0.01,
        "codec-values": "fp32",
        "codec-min-dims": 2,
        "error-feedback": True,
    },
    "train": {
        "local-steps": 20,
        "lr": 3e-3,
        "warmup-steps": 20,
        "min-lr-ratio": 0.1,
        "weight-decay": 0.1,
        "clip-norm": 1.0,
        "batch-size": 8,
        "seq-len": 128,
    },
    "model": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv-heads": 0,
        "intermediate": 0,
        "vocab-size": 2048,
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


def _off_or_at_least_one(value: float) -> None:
    if value != 0 and not value >= 1:
        raise ValueError("must be >= 1, or 0 for off")


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
    "strategy.name": choices(*STRATEGIES),
    "strategy.merge": _merge_name,
    "strategy.outer-lr": _default_or_positive,
    "strategy.outer-momentum": _default_or_non_negative,
    "strategy.orthogonalize": choices("gradient", "update"),
    "strategy.min-nodes": positive,
    "strategy.fraction-train": in_range(0.0, 1.0, lo_open=True),
    "strategy.max-update-norm": non_negative,
    "strategy.max-norm-ratio": non_negative,
    "strategy.max-weight-ratio": _off_or_at_least_one,
    "strategy.max-empty-rounds": non_negative,
    "strategy.upload-codec": choices("none", "int8", "fp8", "topk"),
    "strategy.codec-block-size": in_range(1, 1 << 20),
    "strategy.codec-fraction": in_range(0.0, 1.0, lo_open=True),
    "strategy.codec-values": choices("fp32", "int8"),
    "strategy.codec-min-dims": in_range(0, 8),
    "train.local-steps": positive,
    "train.lr": positive,
    "train.warmup-steps": non_negative,
    "train.min-lr-ratio": in_range(0.0, 1.0),
    "train.weight-decay": non_negative,
    "train.clip-norm": non_negative,
    "train.batch-size": positive,
    "train.seq-len": positive,
    "model.hidden": positive,
    "model.layers": positive,
    "model.heads": positive,
    "model.kv-heads": non_negative,
    "model.intermediate": non_negative,
    "model.vocab-size": in_range(300, 65535),
    "data.corpus": _corpus,
    "data.val-fraction": in_range(0.0, 0.5, lo_open=True),
    "data.val-tokens": positive,
    "data.cache-dir": absolute_path(allow_empty=True),
}


def load_config(run_config: Mapping[str, Any]) -> DictConfig:
    """Validated app config (raises :class:`RunConfigError` naming the bad key)."""
    cfg = read_run_config(run_config, DEFAULTS, VALIDATORS)
    s = cfg.strategy
    if s.name == "fedavg":
        for key, unset in (("merge", ""), ("outer-lr", -1.0), ("outer-momentum", -1.0)):
            if s[key] != unset and not (key == "merge" and s[key] == "mean"):
                raise RunConfigError(
                    f"run-config key 'strategy.{key}' = {s[key]!r} conflicts with strategy.name "
                    "'fedavg' (FedAvg is mean merge, outer lr 1, no momentum); use 'diloco'"
                )
    if s.fast and s.name != "isoloco":
        raise RunConfigError(
            f"run-config key 'strategy.fast' = true needs strategy.name 'isoloco', got {s.name!r}"
        )
    if s.fast and s.merge not in ("", "iso_c", "iso_c_ns"):
        raise RunConfigError(
            f"run-config key 'strategy.fast' = true conflicts with strategy.merge {s.merge!r}"
        )
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


def config_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def output_dir(cfg: DictConfig, run_id: int) -> Path:
    """``output-dir``, or ``~/flwr_isoloco_runs/isoloco_lm/<UTC time>-run<run id>`` if empty."""
    if cfg["output-dir"]:
        return Path(os.path.expanduser(cfg["output-dir"]))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path.home() / "flwr_isoloco_runs" / "isoloco_lm" / f"{stamp}-run{run_id}"


def cache_dir(cfg: DictConfig) -> Path | None:
    return Path(cfg.data["cache-dir"]) if cfg.data["cache-dir"] else None


# ----------------------------------------------------------------------------- model and data
def build_model(cfg: DictConfig) -> torch.nn.Module:
    return build_llama(llama_config(**model_kwargs(cfg)), seed=cfg.seed)


@functools.lru_cache(maxsize=4)
def _tokens(corpus: str, vocab: int, val_fraction: float, cache: str | None):
    # Per-process memo (simulation actors reuse it); the files on disk are the real cache.
    return prepare_tokens(corpus, vocab, val_fraction, cache)


def text_data(cfg: DictConfig):
    cache = cache_dir(cfg)
    data = _tokens(
        cfg.data.corpus,
        cfg.model["vocab-size"],
        cfg.data["val-fraction"],
        str(cache) if cache else None,
    )
    if data.vocab_size != cfg.model["vocab-size"]:
        raise RunConfigError(
            f"run-config key 'model.vocab-size' = {cfg.model['vocab-size']}: the corpus only supports "
            f"a BPE vocabulary of {data.vocab_size}"
        )
    return data


def batch_generator(seed: int, partition_id: int, index: int) -> torch.Generator:
    """The generator of batch ``index`` of a node: seeded by ``(seed, partition, index)``,
    reduced mod 2**64 so that no seed overflows ``manual_seed`` (smaller seeds unchanged)."""
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + partition_id) * 1_000_033 + index) % 2**64
    )


def node_batches(cfg: DictConfig, partition_id: int, num_partitions: int):
    """``batch(i)``: the node's i-th training batch, random windows of its contiguous shard,
    seeded by (seed, partition, i) so a resumed node draws exactly the same batches."""
    shard = shard_tokens(text_data(cfg).train, partition_id, num_partitions)
    bs, seq, seed = cfg.train["batch-size"], cfg.train["seq-len"], cfg.seed

    def batch(index: int) -> torch.Tensor:
        g = batch_generator(seed, partition_id, index)
        return sample_batch(shard, bs, seq, g)

    return batch


# A node's own text: ``--node-config "... data-path='/abs/site/data'"`` (a .txt/.md file or a
# folder of them). The node trains on all of it, encoded with the run's tokenizer (the one
# trained on the training split of ``data.corpus``), so server and nodes share one vocabulary.
DATA_PATH_KEY = "data-path"


class NodeDataError(ValueError):
    """A node's ``data-path`` cannot be used (missing, unreadable, empty, too short)."""


@functools.lru_cache(maxsize=4)
def _encode_local(text: str, tokenizer_path: str) -> np.ndarray:
    # Per-process memo (simulation actors reuse it across rounds).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return np.asarray(tok.encode(text).ids, dtype=np.int32)


def local_tokens(cfg: DictConfig, data_path: str, partition_id: int) -> np.ndarray:
    """All of the node's own text at ``data_path``, encoded with the run's tokenizer (no
    sharding). Raises :class:`NodeDataError` naming the node's partition-id and the path."""

    def fail(reason: str) -> NodeDataError:
        return NodeDataError(
            f"node partition-id {partition_id}: node-config {DATA_PATH_KEY}={data_path!r}: {reason}"
        )

    path = os.path.expanduser(data_path)
    if not os.path.isabs(path):
        raise fail("must be an absolute path to a .txt/.md file or a folder of them")
    if not os.path.exists(path):
        raise fail("no such file or directory")
    try:
        docs = load_corpus(path)  # the same local-path loader (and cleaning) as data.corpus
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read it ({type(exc).__name__}: {exc})") from exc
    text = "\n".join(docs)  # joined as split_text joins the corpus documents
    if not text.strip():
        raise fail("holds no text")
    tokens = _encode_local(text, str(text_data(cfg).tokenizer_path))
    need = cfg.train["seq-len"] + 2
    if len(tokens) < need:
        raise fail(
            f"{len(tokens)} tokens are too few for train.seq-len {cfg.train['seq-len']} "
            f"(need at least {need})"
        )
    return tokens


def local_batches(cfg: DictConfig, data_path: str, partition_id: int):
    """Like :func:`node_batches`, but random windows of the node's own text (``data-path``),
    seeded the same way; the text is read and encoded now, so a bad path fails at once."""
    tokens = local_tokens(cfg, data_path, partition_id)
    bs, seq, seed = cfg.train["batch-size"], cfg.train["seq-len"], cfg.seed

    def batch(index: int) -> torch.Tensor:
        g = batch_generator(seed, partition_id, index)
        return sample_batch(tokens, bs, seq, g)

    return batch


def validation_batches(cfg: DictConfig) -> list[torch.Tensor]:
    from flwr_isoloco.data.text import eval_batches

    return list(eval_batches(text_data(cfg).val, 16, cfg.train["seq-len"], cfg.data["val-tokens"]))


def evaluate_model(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Token-weighted mean next-token cross-entropy over ``batches``."""
    from flwr_isoloco.clients.diloco_worker import next_token_loss

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            loss, n = next_token_loss(model, b)
            total += float(loss) * n
            count += n
    return total / count


# ----------------------------------------------------------------------------- strategy
def build_strategy(cfg: DictConfig):
    """DiLoCo / IsoLoCo / FedAvg (= DiLoCo(mean, lr 1, momentum 0)) from the app config via
    the strategies' own ``from_run_config``; server-side evaluation only."""
    from flwr_isoloco.strategies import DiLoCo, IsoLoCo

    s = cfg.strategy
    flat: dict[str, Any] = {
        "strategy.nesterov": s.nesterov,
        "strategy.orthogonalize": s.orthogonalize,
        "strategy.min-train-nodes": s["min-nodes"],
        "strategy.min-available-nodes": s["min-nodes"],
        "strategy.min-evaluate-nodes": 0,
        "strategy.fraction-train": s["fraction-train"],
        "strategy.fraction-evaluate": 0.0,
        "strategy.max-update-norm": s["max-update-norm"],
        "strategy.max-norm-ratio": s["max-norm-ratio"],
        "strategy.max-weight-ratio": s["max-weight-ratio"],
        "strategy.max-empty-rounds": s["max-empty-rounds"],
        "strategy.seed": cfg.seed,
        "strategy.upload-codec": s["upload-codec"],
        "strategy.codec-block-size": s["codec-block-size"],
        "strategy.codec-fraction": s["codec-fraction"],
        "strategy.codec-values": s["codec-values"],
        "strategy.codec-min-dims": s["codec-min-dims"],
        "strategy.error-feedback": s["error-feedback"],
    }
    if s.name == "fedavg":
        flat.update(
            {"strategy.merge": "mean", "strategy.outer-lr": 1.0, "strategy.outer-momentum": 0.0}
        )
        return DiLoCo.from_run_config(flat)
    if s.merge:
        flat["strategy.merge"] = s.merge
    if s["outer-lr"] != -1.0:
        flat["strategy.outer-lr"] = s["outer-lr"]
    if s["outer-momentum"] != -1.0:
        flat["strategy.outer-momentum"] = s["outer-momentum"]
    if s.name == "isoloco":
        if s.fast:
            flat["strategy.fast"] = True
            flat.pop("strategy.merge", None)
        return IsoLoCo.from_run_config(flat)
    return DiLoCo.from_run_config(flat)


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


# ----------------------------------------------------------------------------- node state files
# A node's ``context.state`` (AdamW moments, data cursor) lives only as long as the run. To make
# ``resume-from`` exact, each node also writes it after every train round to
# ``<state-dir>/node-p<partition-id>-r<round>.safetensors`` (keeping its last two), and a node of
# a resumed run whose state is empty reads the newest file at or before the checkpoint's round.
STATE_DIR_KEY = "node-state-dir"
RESUME_DIR_KEY = "resume-node-state-dir"
RESUME_ROUND_KEY = "resume-round"
_STATE_FILE = re.compile(r"node-p(\d+)-r(\d+)\.safetensors$")


def _state_files(folder: Path, partition_id: int) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STATE_FILE.match(p.name)
        if m and int(m.group(1)) == partition_id:
            out.append((int(m.group(2)), p))
    return sorted(out)


NODE_STATE = "node-state"  # the ``app`` (kind) of a node-state file
NODE_STATE_SPEC = {
    "partition-id": Field("int", min=0),
    "round": Field("int", min=0),
    "records": RECORDS_FIELD,
}


def save_node_state(
    state, folder: Path, partition_id: int, server_round: int, keep: int = 2
) -> None:
    """Write ``state`` (a RecordDict) to this node's file for ``server_round``; keep the last
    ``keep`` files. The meta names the kind, partition and round (checked on reading)."""
    tensors, meta = recorddict_to_tree(state)
    save_checkpoint(
        folder / f"node-p{partition_id}-r{server_round}.safetensors",
        tensors,
        {"app": NODE_STATE, "partition-id": partition_id, "round": server_round, "records": meta},
    )
    for _, old in _state_files(folder, partition_id)[:-keep]:
        old.unlink(missing_ok=True)


def restore_node_state(state, folder: Path, partition_id: int, upto_round: int) -> int | None:
    """Fill an empty ``state`` from the newest file of this node at round <= ``upto_round``.

    The file is verified (:func:`~flwr_isoloco.checkpoint.load_checkpoint` with kind
    ``node-state`` and :data:`NODE_STATE_SPEC`) and its partition and round must be those of
    its name; any problem is a ``CheckpointError`` naming the file and field, and ``state`` is
    left untouched.
    """
    files = [(r, p) for r, p in _state_files(folder, partition_id) if r <= upto_round]
    if not files:
        return None
    rnd, path = files[-1]
    tensors, meta = load_checkpoint(path, kind=NODE_STATE, spec=NODE_STATE_SPEC)
    for field, want in (("partition-id", partition_id), ("round", rnd)):
        if meta[field] != want:
            raise checkpoint_error(
                path, f"field {field!r} is {meta[field]!r}, the name says {want}"
            )
    with restoring(path):
        records = tree_to_recorddict(tensors, meta["records"])
    for key, rec in records.items():
        state[key] = rec
    return rnd
