"""A tiny randomly initialised ``LlamaForCausalLM`` and its byte-level BPE tokenizer, saved with
``save_pretrained``: the stand-in for a user's pretrained Hugging Face folder in tests."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
) * 4


def save_tiny_llama(
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    tied: bool = True,
    max_positions: int = 64,
    seed: int = 0,
) -> Path:
    """Write a 2-layer hidden-32 LLaMA (tied embeddings by default) stored in ``dtype`` and a
    320-token BPE to ``folder``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder
