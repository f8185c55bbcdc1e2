"""`weight_health`, what the run-health guard reads after each update: the parameters' L2 norm and
the exact count of non-finite elements in parameters and optimizer state (0 when all is finite)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlcore.workers.trainable import Trainable
from rlcore.workers.weight_health import weight_health


def _trained() -> Trainable:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 64, (2, 5))).logits.sum().backward()
    optimizer.step()  # optimizer state exists
    return Trainable(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))


def test_norm_and_nonfinite_count():
    trained = _trained()
    cpu = torch.device("cpu")
    norm, bad = weight_health(trained, cpu)
    want = math.sqrt(sum(float(p.detach().double().square().sum()) for p in trained.model.parameters()))
    assert norm == pytest.approx(want, rel=1e-5) and bad == 0.0
    params = list(trained.model.parameters())
    with torch.no_grad():
        params[0].view(-1)[:3] = float("nan")
        params[1].view(-1)[0] = float("inf")
    trained.optimizer.state[params[2]]["exp_avg"].view(-1)[:2] = float("-inf")
    norm, bad = weight_health(trained, cpu)
    assert not math.isfinite(norm) and bad == 6.0
    with torch.no_grad():  # finite values whose squares overflow: an infinite norm, nothing non-finite
        params[0].fill_(3e38)
        params[1].fill_(1.0)
    trained.optimizer.state[params[2]]["exp_avg"].zero_()
    norm, bad = weight_health(trained, cpu)
    assert norm == math.inf and bad == 0.0
