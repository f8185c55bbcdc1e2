"""Tiny random transformers models and batches for the tests that compare one forward path with
another (packed vs padded, sequence-parallel vs one process): a Llama (multi-head, untied head), a
Qwen2 with grouped-query attention (2 key/value heads for 4 query heads, tied embeddings) and a
Qwen2 with one key/value head, each set up as `load_causal_lm` sets it up (`rlcore_varlen`
attention), with a language-model head or a one-label token-classification head (values)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from rlcore.data.preference import sequence_tensors
from rlcore.workers.attention import use_packed_attention
from rlcore.workers.model_checks import check_packed_forward

VOCAB = 64
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512,
             pad_token_id=0)
ARCHS = {
    "llama": (LlamaConfig(**SIZES, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
              LlamaForCausalLM, LlamaForTokenClassification),
    "qwen2-gqa": (Qwen2Config(**SIZES, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                  Qwen2ForCausalLM, Qwen2ForTokenClassification),
    "qwen2-1kv": (Qwen2Config(**SIZES, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
                  Qwen2ForCausalLM, Qwen2ForTokenClassification),
}


def tiny_model(arch: str, head: str = "lm", seed: int = 0, checkpointing: bool = False) -> torch.nn.Module:
    """A freshly initialised (seeded) model of `arch`: head "lm" for log-probs, anything else for values."""
    config, lm, values = ARCHS[arch]
    torch.manual_seed(seed)
    if head == "lm":
        model = lm(config)
    else:
        model = values(config.__class__(**{**config.to_dict(), "num_labels": 1, "classifier_dropout": 0.0}))
    use_packed_attention(model)
    check_packed_forward(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def random_rows(prompt_lens: list[int], response_lens: list[int], seed: int = 0, **widths: int) -> dict[str, torch.Tensor]:
    """The rollout layout (left-padded prompts, right-padded responses) of random tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in response_lens]
    return sequence_tensors(prompts, responses, pad_id=0, **widths)


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str = "") -> None:
    """Gradients equal up to float32 sums in another order: 1e-4 of each parameter's largest entry."""
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-4 * max(float(g.abs().max()), 1e-6), rtol=1e-4, msg=f"{what}: {name}")
