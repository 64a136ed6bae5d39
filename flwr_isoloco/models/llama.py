"""Small LLaMA-style causal LMs built from scratch (``transformers.LlamaConfig``).

Sizes come from the run config; the isoloco-lm default (hidden 128, 2 layers, 4 heads, MLP 344,
vocab 2048, untied) has 0.92M parameters, dominated by the embedding and LM head.
Initialisation is seeded and independent of the global RNG state.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["llama_config", "build_llama", "count_parameters"]


def llama_config(
    *,
    vocab_size: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 0,
    intermediate: int = 0,
    max_seq_len: int = 128,
    tie_embeddings: bool = False,
) -> LlamaConfig:
    """LlamaConfig for a from-scratch model. ``kv_heads=0`` means ``heads`` (plain MHA);
    ``intermediate=0`` means the LLaMA rule ``round_up_to_8(8/3 * hidden)``."""
    for name, value in (
        ("vocab_size", vocab_size),
        ("hidden", hidden),
        ("layers", layers),
        ("heads", heads),
        ("max_seq_len", max_seq_len),
    ):
        if value < 1:
            raise ValueError(f"model {name} must be >= 1, got {value}")
    if hidden % heads:
        raise ValueError(f"model hidden ({hidden}) must be divisible by heads ({heads})")
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"model heads ({heads}) must be divisible by kv-heads ({kv_heads})")
    if (hidden // heads) % 2:
        raise ValueError(
            f"head dim hidden/heads = {hidden // heads} must be even (rotary embeddings)"
        )
    intermediate = intermediate or 8 * -(-(8 * hidden) // 24)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


def _no_init_weights():
    """transformers' context that skips weight initialisation (its module moved in 5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def build_llama(config: LlamaConfig, seed: int = 0, init: bool = True) -> LlamaForCausalLM:
    """``LlamaForCausalLM(config)`` with weights drawn from a fork of the RNG seeded by ``seed``.

    ``init=False``: the weights are left as allocated (arbitrary values), for a caller that
    overwrites every one of them next, as a worker loading the server's model does (its load
    refuses a message that lacks any): 135M builds in ~0.05 s instead of ~4 s on a CPU.
    Buffers computed in ``__init__`` (the rotary frequencies) are made as usual."""
    if not init:
        with _no_init_weights():
            model = LlamaForCausalLM(config)
        model.tie_weights()  # skipped with the initialisation; a tied config keeps its tie
        return model.float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())
