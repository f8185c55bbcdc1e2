"""The tiny example's policy: a small Llama, randomly initialised from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 8  # 8 heads learned addition ~2x sooner than 4 heads
    head_dim: int = 32  # decoupled from hidden/heads (=16): vLLM's CPU attention needs >= 32
    max_position_embeddings: int = 128
    vocab_multiple: int = 8  # pad the vocabulary for friendlier matmul shapes


def make_model(tokenizer, spec: TinyModelSpec, seed: int) -> LlamaForCausalLM:
    """A freshly initialised LlamaForCausalLM sized for `tokenizer` (tied embeddings)."""
    vocab = -(-len(tokenizer) // spec.vocab_multiple) * spec.vocab_multiple
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
