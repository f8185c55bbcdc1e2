"""End-to-end control flows on the tiny example: GRPO, PPO, checkpoints, resume after SIGKILL,
NaN handling and failing reward functions. All on the in-process backend."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path
from transformers import AutoModelForCausalLM

from rlcore.algos import register_policy_loss, vanilla_policy_loss
from rlcore.checkpoint import CheckpointManager, step_of
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.tracking import read_jsonl
from rlcore.trainer.run import make_trainer
from rlcore.trainer.run_state import TrainingStopped

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Small and quick: 8 prompts x 4 samples per step, validation on the held-out file.
QUICK = [
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
    "data.val_batch_size=128",
    "trainer.val_every=100",
    "trainer.loggers=[jsonl]",
    SCORE_IN_PROCESS,
]


def _config(example, out: Path, algorithm: str = "grpo", extra: tuple[str, ...] = ()):
    overrides = tiny_example_overrides(example, str(out)) + QUICK + list(extra)
    return load_config(CONFIG_DIR / f"tiny_{algorithm}.yaml", overrides)


def _steady(record: dict) -> dict:
    """Metrics that must reproduce exactly (timings and throughput never do)."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))}


def test_grpo_two_steps_writes_loadable_checkpoint(tiny_example, tmp_path):
    cfg = _config(
        tiny_example,
        tmp_path / "run",
        extra=("trainer.total_steps=2", "trainer.save_every=1", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"),
    )
    history = make_trainer(cfg).fit()
    assert len(history) == 2
    assert history[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # reference == policy at step 1
    assert history[1]["actor/kl"] > 0
    for m in history:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        assert 0.0 <= m["acc/mean"] <= 1.0
        assert m["response_length/mean"] >= 1
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0 is the validation before training
    assert "val/acc" in records[0] and "val/acc" in records[-1]

    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints").latest()
    assert step_of(ckpt) == 2
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor", local_files_only=True)
    saved = load_file(ckpt / "actor" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor)
    # the policy moved away from the SFT start
    start = load_file(Path(tiny_example.model_dir) / "model.safetensors")
    assert any(not torch.equal(start[k], saved[k]) for k in saved)


def test_ppo_two_steps_trains_critic_with_kl_in_reward(tiny_example, tmp_path):
    cfg = _config(
        tiny_example,
        tmp_path / "run",
        "ppo",
        extra=("trainer.total_steps=2", "trainer.save_every=2", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.01"),
    )
    history = make_trainer(cfg).fit()
    assert all(math.isfinite(m["critic/vf_loss"]) for m in history)
    # step 1: policy == reference, so the KL penalty is exactly zero; step 2 has moved
    assert history[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert history[1]["actor/reward_kl_penalty"] != 0  # k1 is a signed estimate
    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints").latest()
    assert (ckpt / "critic" / "config.json").is_file() and (ckpt / "critic_optim.pt").is_file()


def _cli_train(example, out: Path, steps: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlcore.cli", "train", str(CONFIG_DIR / "tiny_grpo.yaml")]
    args += tiny_example_overrides(example, str(out)) + QUICK
    args += [f"trainer.total_steps={steps}", "trainer.save_every=2", "trainer.keep_last=5", "trainer.val_before_train=false"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_resume_after_sigkill_matches_uninterrupted_run(tiny_example, tmp_path):
    steps = 4
    straight = _cli_train(tiny_example, tmp_path / "straight", steps)
    _, err = straight.communicate(timeout=scaled(600))
    assert straight.returncode == 0, err

    killed_dir = tmp_path / "killed"
    victim = _cli_train(tiny_example, killed_dir, steps)
    deadline = time.time() + scaled(600)
    while not (killed_dir / "checkpoints" / "step_00000002" / "COMPLETE.json").exists():
        assert victim.poll() is None, victim.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed_dir / "checkpoints" / "step_00000004").exists()

    resumed = _cli_train(tiny_example, killed_dir, steps)  # trainer.resume=auto by default
    _, err = resumed.communicate(timeout=scaled(600))
    assert resumed.returncode == 0, err

    a = load_file(tmp_path / "straight" / "checkpoints" / "step_00000004" / "actor" / "model.safetensors")
    b = load_file(killed_dir / "checkpoints" / "step_00000004" / "actor" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ma = [_steady(r) for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    mb = [_steady(r) for r in read_jsonl(killed_dir / "metrics.jsonl")]
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    assert ma == mb


def _nan_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kw):
    loss, metrics = vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kw)
    return loss * float("nan"), metrics


def test_nan_losses_are_skipped_then_stop_the_run_keeping_good_checkpoint(tiny_example, tmp_path):
    register_policy_loss("test_nan", overwrite=True)(_nan_policy_loss)
    out = tmp_path / "run"
    good = _config(tiny_example, out, extra=("trainer.total_steps=1", "trainer.save_every=1", "trainer.val_before_train=false"))
    make_trainer(good).fit()
    before = load_file(out / "checkpoints" / "step_00000001" / "actor" / "model.safetensors")

    bad = _config(
        tiny_example,
        out,
        extra=("trainer.total_steps=5", "trainer.save_every=1", "actor.policy_loss=test_nan", "actor.max_consecutive_bad_steps=2"),
    )
    with pytest.raises(TrainingStopped, match="2 steps in a row"):
        make_trainer(bad).fit()
    latest = CheckpointManager(out / "checkpoints").latest()
    after = load_file(latest / "actor" / "model.safetensors")
    # the skipped steps never changed the weights
    assert all(torch.equal(before[k], after[k]) for k in before)
    records = read_jsonl(out / "metrics.jsonl")
    assert records[-1]["train/bad_steps_total"] >= 1


def test_reward_function_that_raises_is_counted_and_training_goes_on(tiny_example, tmp_path):
    fn = tmp_path / "flaky_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str.strip().endswith('0'):\n"
        "        raise RuntimeError('no zeros please')\n"
        "    return 1.0\n"
    )
    cfg = _config(
        tiny_example,
        tmp_path / "run",
        extra=("trainer.total_steps=2", "trainer.val_before_train=false", f"reward.function={fn}:compute_score", "reward.error_score=-1.0",
               "reward.num_workers=2",  # on the scorer pool: the function raises in its worker processes
               "reward.max_error_fraction=0.5"),  # ~1 in 10 answers ends in 0: below the limit, the run goes on
    )
    history = make_trainer(cfg).fit()
    assert len(history) == 2
    errors = sum(m["reward/errors"] for m in history)
    assert errors > 0
    assert any("no zeros please" in m.get("reward/first_error", "") for m in history)
    assert any(m["reward/mean"] < 1.0 for m in history)  # the failed items got error_score


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_bfloat16_rollout_beside_a_float32_actor(tiny_example, tmp_path, backend):
    """rollout.dtype=bfloat16: the engine samples in bf16, the actor keeps float32 weights and
    recomputes the log-probs; the gap is small, nonzero, and reported every step."""
    if backend == "vllm":
        pytest.importorskip("vllm")
    cfg = _config(tiny_example, tmp_path / "run",
                  extra=("trainer.total_steps=2", "trainer.save_every=2", f"rollout.backend={backend}",
                         "rollout.dtype=bfloat16"))
    trainer = make_trainer(cfg)
    engine = trainer.groups.rollout.workers[0].engine  # (fit() shuts the workers down at the end)
    if backend == "hf":
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    else:
        assert engine.llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    history = trainer.fit()
    for m in history:
        assert 0 < m["rollout/logprob_diff_mean"] < 0.05, m["rollout/logprob_diff_mean"]
    saved = load_file(CheckpointManager(tmp_path / "run" / "checkpoints").latest() / "actor" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
