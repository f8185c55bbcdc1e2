"""The critic's value model: deterministic in training mode (no dropout before the value head)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.workers.modeling import load_value_model


def test_value_head_has_no_dropout(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_value_model(tmp_path, "float32", torch.device("cpu"))
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, first, rtol=0, atol=0)
