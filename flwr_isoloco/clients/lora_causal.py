"""Causal-LM task of the peft LoRA client: LoRA on a pretrained causal LM, private text shards,
held-out perplexity (the setting of Flower's FlowerTune LLM example).

- **Model.** Any ``AutoModelForCausalLM`` (a local folder, a GGUF file, a Hub name), loaded by
  :func:`flwr_isoloco.models.hf.load_causal_lm` in ``dtype``, wrapped by peft with
  ``TaskType.CAUSAL_LM``. LoRA goes on ``target_modules``, or, when none are named, on the
  modules :func:`target_modules_for` gives for the model's ``config.model_type``. The LoRA init
  is drawn from ``seed``, so every node and the server build the same starting adapter and only
  the adapter travels (``lora_A``/``lora_B`` of each target module, fp32).
- **Data.** The corpus (:func:`flwr_isoloco.data.text.load_corpus`: ``"shakespeare"``, a local
  ``.txt``/``.md`` file or folder, or a Hub data set) is split by characters
  (:func:`~flwr_isoloco.data.text.split_text`: the last ``val_fraction`` is held out; no node
  trains on it), both parts tokenized with the model's own tokenizer (cached per tokenizer
  and text). The training stream is cut into rows
  of ``seq_len + 1`` tokens and split into contiguous private shards by flwr-datasets'
  ``IidPartitioner`` (:func:`~flwr_isoloco.data.text.shard_tokens`). A node whose node config
  has a non-empty ``data-path`` trains on that text instead.
- **Loss and metric.** Next-token cross-entropy on a row; held-out perplexity
  ``exp(sum of token NLL / number of predicted tokens)`` over non-overlapping windows of the
  held-out text (:func:`heldout_nll`).
- **Device and precision.** ``device`` / ``precision`` / ``compile`` as the sentence client's
  (:mod:`flwr_isoloco.clients.lora_client`): the batches go to the model's device, the loss
  (and the held-out NLL) under the precision's autocast, the adapter and its moments fp32.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flwr_isoloco.clients.diloco_worker import next_token_loss
from flwr_isoloco.clients.hf_lm import corpus_tokens as hf_corpus_tokens
from flwr_isoloco.clients.hf_lm import encode_text, tokenizer_digest
from flwr_isoloco.clients.lora_client import check_train_options, model_device
from flwr_isoloco.clients.precision import autocast
from flwr_isoloco.data import text as textdata
from flwr_isoloco.models import classifier
from flwr_isoloco.models.export import quiet_hf

__all__ = [
    "CAUSAL_LM_TARGETS",
    "CausalLoRASpec",
    "CausalLoRAClientConfig",
    "CausalLoRAModel",
    "CAUSAL_TASK",
    "target_modules_for",
    "get_causal_model",
    "corpus_tokens",
    "heldout_nll",
]

# model_type -> LoRA target modules. The attention query and value projections, as in the
# LoRA paper and in FlowerTune's LLM example (peft's defaults there); a model_type missing here
# falls back to peft's own table (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
CAUSAL_LM_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
    "gpt_neox": ("query_key_value",),
}


def target_modules_for(model_type: str) -> tuple[str, ...]:
    """LoRA target modules of an architecture: :data:`CAUSAL_LM_TARGETS`, else peft's table;
    ``ValueError`` (asking for explicit names) when neither knows ``model_type``."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    names = CAUSAL_LM_TARGETS.get(model_type) or PEFT.get(model_type)
    if not names:
        raise ValueError(
            f"no default LoRA target modules for model_type {model_type!r}: name them "
            "(target_modules=..., e.g. the attention projections)"
        )
    return tuple(names)


@dataclass(frozen=True)
class CausalLoRASpec:
    """Everything that determines the model a node builds (hashable: a cache key)."""

    model: str
    gguf_file: str = ""
    tokenizer: str = ""  # "" = the model's own
    dtype: str = "float32"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()  # () = target_modules_for(config.model_type)
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("causal LM spec needs a model (folder, GGUF folder or Hub name)")
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora r must be a positive int, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(f"lora target_modules must be names, got {self.target_modules!r}")


@dataclass
class CausalLoRAModel:
    """A built peft causal LM, its tokenizer and the adapter as initialised."""

    model: torch.nn.Module
    tokenizer: object
    initial_adapter: dict[str, torch.Tensor]
    target_modules: tuple[str, ...]


def build_causal_model(spec: CausalLoRASpec) -> CausalLoRAModel:
    """Base model frozen, LoRA on the target modules with a seeded init."""
    from peft import LoraConfig, TaskType, get_peft_model

    from flwr_isoloco.models.hf import load_causal_lm

    with quiet_hf():
        base, tok = load_causal_lm(
            spec.model,
            gguf_file=spec.gguf_file or None,
            dtype=spec.dtype,
            tokenizer=spec.tokenizer or None,
        )
    targets = spec.target_modules or target_modules_for(base.config.model_type)
    names = [n for n, _ in base.named_modules()]
    missing = [m for m in targets if not any(n == m or n.endswith("." + m) for n in names)]
    if missing:
        raise ValueError(f"lora target module(s) {missing} not found in model {spec.model!r}")
    cfg = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(targets),
        bias="none",
    )
    with quiet_hf(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = get_peft_model(base, cfg)
    model.eval()
    return CausalLoRAModel(model, tok, classifier.adapter_state_dict(model), tuple(targets))


@functools.lru_cache(maxsize=2)
def _cached(spec: CausalLoRASpec, slot: str) -> CausalLoRAModel:
    return build_causal_model(spec)


def get_causal_model(spec: CausalLoRASpec, slot: str = "client") -> CausalLoRAModel:
    """Per-process cached model, one per ``slot`` (the server evaluates on its own copy). A
    speed-up only: every message loads the full adapter before the model is used."""
    return _cached(spec, slot)


# ----------------------------------------------------------------------------- data


_TOKENS: dict[tuple[str, float, str], tuple[np.ndarray, np.ndarray]] = {}


def corpus_tokens(
    tokenizer, corpus: str, val_fraction: float, cache_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids) of ``corpus`` in ``tokenizer``'s vocabulary: the LM app's
    :func:`flwr_isoloco.clients.hf_lm.corpus_tokens` (cached as ``.npy`` per tokenizer and
    text), also cached in the process."""
    key = (corpus, float(val_fraction), tokenizer_digest(tokenizer))
    if key not in _TOKENS:
        if len(_TOKENS) > 8:
            _TOKENS.clear()
        train, val, _ = hf_corpus_tokens(corpus, tokenizer, val_fraction, cache_dir)
        _TOKENS[key] = (train, val)
    return _TOKENS[key]


_SITE: dict[tuple[str, str, int, int], np.ndarray] = {}


def site_tokens(tokenizer, path: str) -> np.ndarray:
    """Token ids of a site's own text (``load_corpus(path)``: a file or folder), cached in the
    process by (tokenizer, path, modification time, size)."""
    st = os.stat(os.path.expanduser(path))
    key = (tokenizer_digest(tokenizer), path, st.st_mtime_ns, st.st_size)
    if key not in _SITE:
        if len(_SITE) > 8:
            _SITE.clear()
        with quiet_hf():
            _SITE[key] = encode_text("\n".join(textdata.load_corpus(path)), tokenizer)
    return _SITE[key]


@dataclass
class TextShard:
    """A node's training rows ``(rows, seq_len + 1)`` and the held-out tokens."""

    train_rows: np.ndarray
    val_tokens: np.ndarray


@dataclass(frozen=True)
class CausalLoRAClientConfig:
    """Model, data and local-training settings of a node (all nodes must agree on ``lora``)."""

    lora: CausalLoRASpec
    corpus: str = textdata.DEFAULT_CORPUS
    val_fraction: float = 0.05
    seq_len: int = 128
    max_rows: int = 0  # per shard, 0 = all
    eval_tokens: int = 4096  # held-out tokens a client's EVALUATE scores
    data_seed: int = 0
    batch_size: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    local_steps: int = 4
    num_threads: int = 0
    partition_key: str = "partition-id"
    num_partitions_key: str = "num-partitions"
    data_path_key: str = "data-path"
    cache_dir: str = ""  # "" = flwr_isoloco.data.text.default_cache_dir()
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:<index>" (lora_client docstring)
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16": autocast, fp32 adapter and moments
    compile: bool = False  # torch.compile the training forward, once per process

    def __post_init__(self):
        check_train_options(self)
        for name in ("batch_size", "local_steps", "seq_len", "eval_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")

    @property
    def task(self) -> CausalLMTask:
        return CAUSAL_TASK


@torch.no_grad()
def heldout_nll(
    model, tokens: np.ndarray, seq_len: int, batch_size: int = 4, max_tokens: int | None = None
) -> tuple[float, int]:
    """(mean next-token NLL, predicted tokens) over non-overlapping ``seq_len`` windows of the
    first ``max_tokens`` held-out tokens, on the model's device; perplexity is ``exp`` of the
    first."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = model_device(model)
    for batch in textdata.eval_batches(tokens, batch_size, seq_len, max_tokens):
        loss, n = next_token_loss(model, batch.to(device))
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / count, count


def perplexity(nll: float) -> float:
    return math.exp(min(nll, 50.0))


class CausalLMTask:
    """What :class:`~flwr_isoloco.clients.lora_client.LoRAClient` needs of a causal-LM node."""

    name = "causal-lm"

    def model(self, cfg: CausalLoRAClientConfig):
        return get_causal_model(cfg.lora).model

    def tokenizer(self, cfg: CausalLoRAClientConfig):
        return get_causal_model(cfg.lora).tokenizer

    def node_data(self, cfg: CausalLoRAClientConfig, pid: int, n: int, data_path: str = ""):
        built = get_causal_model(cfg.lora)
        limit = getattr(built.model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and cfg.seq_len > limit:
            raise ValueError(
                f"seq_len {cfg.seq_len} is more than the model's max_position_embeddings {limit}"
            )
        tok = built.tokenizer
        train, val = corpus_tokens(tok, cfg.corpus, cfg.val_fraction, cfg.cache_dir or None)
        block = cfg.seq_len + 1
        if data_path:
            stream = site_tokens(tok, data_path)
            what = f"data path {data_path!r}"
        else:
            stream = textdata.shard_tokens(train, pid, n, block=block)
            what = f"partition {pid}"
        rows = stream[: len(stream) // block * block].reshape(-1, block)
        if cfg.max_rows and len(rows) > cfg.max_rows:
            rows = rows[: cfg.max_rows]
        if len(rows) < 1:
            raise ValueError(f"{what} has {len(stream)} tokens: too few for seq_len {cfg.seq_len}")
        return TextShard(rows, val)

    def num_train(self, data: TextShard) -> int:
        return len(data.train_rows)

    def batch_loss(self, model, tokenizer, data: TextShard, idx: Sequence[int], cfg, device=None):
        """Mean next-token loss of rows ``idx``, the batch on ``device`` (None: the CPU)."""
        batch = torch.from_numpy(data.train_rows[np.asarray(idx)].astype(np.int64))
        return next_token_loss(model, batch if device is None else batch.to(device))[0]

    def evaluate(self, model, tokenizer, data: TextShard, cfg) -> dict[str, float]:
        with autocast(model_device(model), cfg.precision):
            nll, count = heldout_nll(
                model, data.val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens
            )
        return {"num-examples": count, "eval_loss": nll, "eval_ppl": perplexity(nll)}


CAUSAL_TASK = CausalLMTask()
