"""Model FLOPs and MFU (`rlcore.flops`) against a hand calculation, device peaks by name, and the
per-step throughput metrics a run reports (on CPU: tokens/s, no MFU unless a peak is configured;
the CUDA and NVML paths cannot run on this machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

from rlcore.flops import ModelFlops, causal_pairs, decode_pairs, mfu, peak_flops_for
from rlcore.protocol import Batch
from rlcore.trainer.metrics import Timer
from rlcore.trainer.throughput import StepThroughput

# Qwen2-style GQA: hidden 64, 2 layers, 4 query heads of 16, 2 kv heads, MLP 128, vocab 100
QWEN = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2).to_dict()


def test_flops_of_a_gqa_model_match_a_hand_count():
    f = ModelFlops.from_hf_config(QWEN)
    # per layer: q and o 64x64 each, k and v 64x32 each, gate/up/down 64x128 each
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert f.body_params == 2 * per_layer == 73_728
    assert f.head_params == 100 * 64 and f.layers == 2 and f.attn_width == 64
    # two sequences of 3 and 5 tokens, 2 + 4 of them response tokens
    pairs = causal_pairs([3, 5])
    assert pairs == 6 + 15  # 1+2+3, 1+..+5
    forward = 2 * 73_728 * 8 + 2 * 6_400 * 6 + 4 * 2 * 64 * 21
    assert f.forward(8, 6, pairs) == forward == 1_267_200
    assert f.training(8, 6, pairs) == 3 * forward
    assert mfu(3 * forward, 0.5, 1e7) == pytest.approx(3 * forward / 0.5 / 1e7)
    assert mfu(3 * forward, 0.5, 1e7, devices=2) == pytest.approx(3 * forward / 1e7)
    assert mfu(1.0, 1.0, None) is None


def test_body_params_are_the_real_models_linear_weights():
    """The config count equals the weights of the model's own nn.Linear layers (LM head apart)."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    f = ModelFlops.from_hf_config(cfg.to_dict())
    assert f.body_params == linear and f.head_params == model.lm_head.weight.numel() and f.attn_width == 96


def test_decode_pairs_count_each_new_token_against_its_context():
    # prompt 4, 3 new tokens: contexts 5, 6, 7
    assert decode_pairs([4], [3]) == 18


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA B200", 2.25e15),
    ("Tesla T4", None),
])
def test_peaks_by_device_name(name, peak):
    assert peak_flops_for(name) == peak


def _gen() -> Batch:
    """4 samples (2 prompts x n=2): prompt lengths 3,3,2,2 (left padded to 3), responses 2,1,3,2."""
    prompt = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    response = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    return Batch(tensors={"attention_mask": torch.cat([prompt, response], 1), "response_mask": response.float()},
                 meta={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


def test_step_throughput_per_phase(tmp_path):
    f = ModelFlops.from_hf_config(QWEN)
    timer = Timer(device_memory=False)
    timer.seconds.update(generate=2.0, old_log_prob=0.5, update_actor=4.0)
    st = StepThroughput(actor=f, critic=None, peak_flops=1e9, devices={"generate": 1, "old_log_prob": 1, "ref_log_prob": 1,
                        "update_actor": 2}, actor_epochs=2, critic_epochs=1)
    m = st.metrics(_gen(), timer, 2)
    seq = [5, 4, 5, 4]
    assert m["throughput/generate_tok_s"] == 8 / 2.0
    assert m["throughput/old_log_prob_tok_s"] == 18 / 0.5
    assert m["throughput/update_actor_tok_s"] == 2 * 18 / 4.0
    assert m["throughput/update_actor_mfu"] == pytest.approx(2 * f.training(18, 8, causal_pairs(seq)) / 4.0 / (2 * 1e9))
    # prefill once per prompt (3 and 2 tokens), then 8 new tokens against prompt + their own
    gen_flops = f.forward(5, 0, causal_pairs([3, 2])) + f.forward(8, 8, decode_pairs([3, 3, 2, 2], [2, 1, 3, 2]))
    assert m["throughput/generate_mfu"] == pytest.approx(gen_flops / 2.0 / 1e9)
    assert not any(k.startswith(("throughput/ref_log_prob", "throughput/values", "gpu/")) for k in m)  # not timed / no GPU

    st.peak_flops = None  # CPU without a configured peak: tokens/s only
    assert not any(k.endswith("_mfu") for k in st.metrics(_gen(), timer, 2))


@pytest.mark.slow
def test_a_ppo_step_reports_tokens_per_second_and_mfu_per_phase(tiny_example, tmp_path, capsys):
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.tracking import read_jsonl
    from rlcore.trainer.run import make_trainer

    cfg = load_config(CONFIG_DIR / "tiny_ppo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=1",
        "trainer.val_before_train=false", "trainer.loggers=[console,jsonl]", "trainer.trace=false",
        "trainer.device_peak_tflops=0.001", "actor.recompute_old_log_prob=always", SCORE_IN_PROCESS])  # a 1 GFLOP/s "device"
    make_trainer(cfg).fit()
    step = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1][0]
    for phase in ("generate", "old_log_prob", "values", "update_critic", "update_actor"):
        assert step[f"throughput/{phase}_tok_s"] > 0, phase
        assert 0 < step[f"throughput/{phase}_mfu"] < 1e4, phase  # CPU vs a made-up peak: any positive number
    assert "throughput/update_actor_mfu=" in capsys.readouterr().err  # on the console line too


def test_a_config_without_the_usual_keys_gives_tokens_per_second_only(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    from rlcore.trainer.throughput import _flops_of

    assert _flops_of(str(tmp_path), "lm") is None
    timer = Timer(device_memory=False)
    timer.seconds.update(update_actor=2.0)
    st = StepThroughput(actor=None, critic=None, peak_flops=1e9, devices={"update_actor": 1}, actor_epochs=1, critic_epochs=1)
    assert st.metrics(_gen(), timer, 2) == {"throughput/update_actor_tok_s": 18 / 2.0}
