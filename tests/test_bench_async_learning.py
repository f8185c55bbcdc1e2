"""benchmarks/bench_async_learning.py: its engine decodes every sampled row to the length it drew
(past the model's own end token, which the reward still reads up to), greedy validation stops at
the end token as rlcore's does, and `--quick` writes the table's columns for each mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.protocol import Batch
from rlcore.rollout import HFRolloutEngine, SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PAD, BOS, EOS, VOCAB = 0, 1, 2, 8  # a small vocabulary: the random model samples EOS early and often


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_async and bench_vs_trl by name, as when run
    import bench_async_learning

    return bench_async_learning


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=PAD,
                      bos_token_id=BOS, eos_token_id=EOS)
    return LlamaForCausalLM(cfg).eval()


def prompts() -> Batch:
    ids = torch.tensor([[PAD, 3, 4, 5], [6, 7, 3, 4]])
    return Batch(tensors={"input_ids": ids, "attention_mask": (ids != PAD).long()})


def test_sampled_rows_run_to_their_drawn_lengths_past_the_end_token(bench, monkeypatch):
    spec = bench.length_spec(64)  # median 4, p99 64, in [4, 64]
    monkeypatch.setenv(bench.LENGTHS_ENV, ",".join(str(x) for x in spec))
    monkeypatch.setenv(bench.FILLER_ENV, "trained")
    m = model()
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=64, seed=11)
    out = bench.LongTailEngine(m, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts(), params)
    want = bench.draw_lengths(16, 11, spec).tolist()
    assert out.tensors["response_mask"].sum(-1).long().tolist() == want
    assert len(set(want)) > 4 and max(want) > 4 * min(want)  # long-tailed, not one length
    # rows went on past an end token they sampled, where rlcore's own engine stops every row
    rows = out.tensors["responses"].tolist()
    assert any(EOS in row[: k - 1] for row, k in zip(rows, want))
    # by default the same rows are decoded, and each is trained up to its first end token only
    monkeypatch.setenv(bench.FILLER_ENV, "generated")
    bench.LongTailEngine.generated[:] = [0, 0]
    default = bench.LongTailEngine(m, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts(), params)
    assert default.tensors["responses"].tolist() == rows
    assert bench.LongTailEngine.generated == [16, sum(want)]
    trained = default.tensors["response_mask"].sum(-1).long().tolist()
    assert trained == [row[:k].index(EOS) + 1 if EOS in row[:k] else k for row, k in zip(rows, want)]
    assert sum(trained) < sum(want)
    plain = HFRolloutEngine(m, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts(), params)
    plain_lengths = plain.tensors["response_mask"].sum(-1).long().tolist()
    assert not any(EOS in row[: k - 1] for row, k in zip(plain.tensors["responses"].tolist(), plain_lengths))


def test_greedy_validation_stops_at_the_end_token(bench, monkeypatch):
    monkeypatch.setenv(bench.LENGTHS_ENV, ",".join(str(x) for x in bench.length_spec(64)))
    m = model()
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=64, seed=0)
    ours = bench.LongTailEngine(m, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts(), greedy)
    plain = HFRolloutEngine(m, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts(), greedy)
    assert torch.equal(ours.tensors["responses"], plain.tensors["responses"])
    assert torch.equal(ours.tensors["response_mask"], plain.tensors["response_mask"])


@pytest.mark.slow
def test_quick_run_writes_every_column_for_each_mode(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_async_learning.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"sync", "async:1"}
    for mode, runs in result["runs"].items():
        (run,) = runs
        for column in ("steps_to_target", "wall_s_to_target", "cpu_s_to_target", "samples_per_wall_s",
                       "samples_per_cpu_s", "trainer_idle_frac", "generated_length_mean", "trained_length_mean", "final_acc"):
            assert column in run, (mode, column)
        assert run["samples_per_wall_s"] > 0 and run["samples_per_cpu_s"] > 0
        assert 0.0 <= run["trainer_idle_frac"] <= 1.0
        assert run["generated_length_mean"] >= 4  # the forced floor
        assert run["trained_length_mean"] < run["generated_length_mean"]  # the filler past the end token is not trained
        assert [step for step, _ in run["acc_curve"]] == [1, 2, 3]
    assert "vs_sync" in result["summary"]["async:1"]
    assert "async:1 vs sync" in proc.stdout
