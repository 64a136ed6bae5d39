"""Exports that load with Hugging Face alone: a causal LM with its tokenizer, a LoRA adapter
with its classification head.

- :func:`export_causal_lm` writes ``model.save_pretrained(d)`` plus the run's byte-level BPE as
  a ``PreTrainedTokenizerFast`` (``tokenizer.json``, ``tokenizer_config.json``), so that
  ``AutoModelForCausalLM.from_pretrained(d)`` and ``AutoTokenizer.from_pretrained(d)`` work
  offline and ``generate`` runs (the generation config's ``eos``/``pad`` are the BPE's
  end-of-text token).
- :func:`export_pretrained` writes a pretrained model (any architecture) with its trained
  weights, its own tokenizer and generation config.
- :func:`export_adapter` writes a peft adapter folder that
  ``PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base,
  num_labels=k), d)`` loads with the classification head included (``modules_to_save``), plus
  the base model's tokenizer. A head that was not trained (``train_head=False``) is a seeded
  random head that the bare base model does not have, so it is exported too: it is added to
  the adapter file and to ``modules_to_save`` in ``adapter_config.json``.

:func:`quiet_hf` (defined in :mod:`.quiet`, re-exported here) silences transformers' per-call
progress bars and info logs around every ``from_pretrained``/``save_pretrained`` of the library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .classifier import load_adapter_state_dict
from .quiet import quiet_hf

__all__ = ["quiet_hf", "export_causal_lm", "export_pretrained", "export_adapter", "EXPORT_MODE"]

EXPORT_MODE = 0o644  # exported files are results: readable by others, like results.json


def _chmod_tree(folder: Path, mode: int = EXPORT_MODE) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            os.chmod(p, mode)


def export_causal_lm(
    model: torch.nn.Module,
    tokenizer_file: str | os.PathLike,
    folder: str | os.PathLike,
    *,
    eos_token: str = "<|endoftext|>",
) -> Path:
    """Write ``model`` and its tokenizer to ``folder`` (see module doc); returns the folder.

    ``tokenizer_file`` is the ``tokenizers`` JSON the model was trained with (the run's BPE).
    The model's own config is left as it was; only the saved generation config names the
    end-of-text id (``eos_token_id`` = ``pad_token_id``), so ``generate`` can stop and pad.
    """
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with quiet_hf():
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_file),
            eos_token=eos_token,
            pad_token=eos_token,
            model_input_names=["input_ids", "attention_mask"],
        )
        eos_id = tok.convert_tokens_to_ids(eos_token)
        gen = getattr(model, "generation_config", None)
        saved = None if gen is None else (gen.eos_token_id, gen.pad_token_id)
        if gen is not None:
            gen.eos_token_id, gen.pad_token_id = eos_id, eos_id
        try:
            model.save_pretrained(str(folder))
        finally:
            if gen is not None and saved is not None:
                gen.eos_token_id, gen.pad_token_id = saved
        tok.save_pretrained(str(folder))
    _chmod_tree(folder)
    return folder


def export_pretrained(model: torch.nn.Module, tokenizer, folder: str | os.PathLike) -> Path:
    """Write a pretrained model with its trained weights: ``model.save_pretrained`` (its own
    architecture, config and generation config; a tied tensor stored once) and its own
    ``tokenizer``. A GGUF source's quantisation settings are not written (the weights are
    de-quantised fp32, or the dtype trained in)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    with quiet_hf():
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
    _chmod_tree(folder)
    return folder


def export_adapter(
    model,
    adapter_state: Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    tokenizer=None,
    head_modules: tuple[str, ...] = ("classifier",),
) -> Path:
    """Load ``adapter_state`` into the peft ``model`` and save it as an adapter folder.

    ``adapter_state`` is the travelling state (peft names, as
    :func:`flwr_isoloco.models.classifier.adapter_state_dict` returns it). Head modules in
    ``head_modules`` that are not in the adapter's ``modules_to_save`` are added to the file and
    the config (see module doc). ``tokenizer`` (optional) is saved beside the adapter.
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    load_adapter_state_dict(model, adapter_state)
    with quiet_hf():
        model.save_pretrained(str(folder))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    saved = list(cfg.get("modules_to_save") or [])
    missing = [m for m in head_modules if m not in saved]
    if missing:
        base = model.get_base_model()
        tensors = load_file(str(weights))
        for name in missing:
            module = base.get_submodule(name)
            for key, t in module.state_dict().items():
                tensors[f"base_model.model.{name}.{key}"] = t.detach().cpu().contiguous()
        save_file(tensors, str(weights), metadata={"format": "pt"})
        cfg["modules_to_save"] = saved + missing
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")
    _chmod_tree(folder)
    return folder
