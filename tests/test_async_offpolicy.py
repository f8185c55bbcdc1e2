"""One-step off-policy GRPO and PPO (`trainer.off_policy=one_step`) on the in-process backend:
the staleness it records, that it still learns, that checkpoint/resume stays exact, and the
control flows that refuse it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_on_ray  # tests/ is on sys.path (pytest rootdir conftest)
from safetensors.torch import load_file
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.tracking import read_jsonl
from rlcore.trainer.run import make_trainer

pytestmark = pytest.mark.slow

QUICK = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.val_batch_size=128",
    "trainer.val_every=100", "trainer.loggers=[jsonl]", "trainer.val_before_train=false",
]


def _config(example, out: Path, extra=(), algorithm: str = "grpo"):
    overrides = tiny_example_overrides(example, str(out)) + QUICK + ["trainer.off_policy=one_step", SCORE_IN_PROCESS, *extra]
    return load_config(CONFIG_DIR / f"tiny_{algorithm}.yaml", overrides)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_staleness_is_zero_at_step_one_then_one_and_zero_after_a_checkpoint(tiny_example, tmp_path, algorithm):
    cfg = _config(tiny_example, tmp_path / "run", ("trainer.total_steps=5", "trainer.save_every=3"), algorithm)
    history = make_trainer(cfg).fit()
    # step 1 generates on-policy; steps 2, 3 were generated during steps 1, 2 on the weights before
    # that step's update; step 3 checkpoints, so step 4 is generated after it (on-policy) and step 5
    # was prefetched during step 4.
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert [m["rollout/staleness_mean"] for m in history] == [0.0, 1.0, 1.0, 0.0, 1.0]
    trace = read_jsonl(tmp_path / "run" / "trace.jsonl")
    versions = [{s["policy_version"] for s in rec["samples"]} for rec in trace]
    assert versions == [{0}, {0}, {1}, {3}, {3}]  # weights after that many actor updates
    # the old log-probs are the actor's own (recomputed), so the rollout's differ once stale
    assert history[0]["rollout/logprob_diff_max"] < 1e-4
    assert history[1]["rollout/logprob_diff_max"] > 1e-4


def test_one_step_consumes_the_same_prompts_as_sync(tiny_example, tmp_path):
    """Prefetching changes when a batch is drawn, never which batch a step trains on."""
    uids = {}
    for mode in ("sync", "one_step"):
        extra = ("trainer.total_steps=3", "trainer.save_every=100", f"trainer.off_policy={mode}")
        make_trainer(_config(tiny_example, tmp_path / mode, extra)).fit()
        uids[mode] = [[s["uid"] for s in rec["samples"]] for rec in read_jsonl(tmp_path / mode / "trace.jsonl")]
    assert uids["sync"] == uids["one_step"]
    assert len({u for step in uids["sync"] for u in step}) == 3 * 8


def test_resume_from_a_checkpoint_matches_the_uninterrupted_run(tiny_example, tmp_path):
    straight = _config(tiny_example, tmp_path / "straight", ("trainer.total_steps=4", "trainer.save_every=2"))
    make_trainer(straight).fit()
    first = _config(tiny_example, tmp_path / "resumed", ("trainer.total_steps=2", "trainer.save_every=2"))
    make_trainer(first).fit()
    again = _config(tiny_example, tmp_path / "resumed", ("trainer.total_steps=4", "trainer.save_every=2"))
    make_trainer(again).fit()

    a = load_file(tmp_path / "straight" / "checkpoints" / "step_00000004" / "actor" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "step_00000004" / "actor" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # timings never reproduce; the 2-step run validates at its last step, the straight one does not
    steady = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "val/"))}  # noqa: E731
    ma = [steady(r) for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    mb = [steady(r) for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")]
    assert ma == mb
    assert [r["rollout/staleness_max"] for r in ma] == [0.0, 1.0, 0.0, 1.0]
    assert [r["step"] for r in read_jsonl(tmp_path / "resumed" / "trace.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize(("algorithm", "steps"), [("grpo", 30), ("ppo", 40)])
def test_one_step_learns_the_tiny_task(tiny_example, tmp_path, algorithm, steps):
    cfg = load_config(
        CONFIG_DIR / f"tiny_{algorithm}.yaml",
        tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
            "trainer.off_policy=one_step", f"trainer.total_steps={steps}", "trainer.save_every=100",
            f"trainer.val_every={steps}", "trainer.loggers=[jsonl]", "data.val_batch_size=256", SCORE_IN_PROCESS,
        ],
    )
    make_trainer(cfg).fit()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    before, after = records[0]["val/acc"], records[-1]["val/acc"]
    assert records[-1]["step"] == steps
    assert after >= before + 0.15, (before, after)
    assert all(r["rollout/staleness_max"] == 1.0 for r in records[2:])


@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_control_flows_without_one_step_refuse_it_naming_the_field(tiny_example, tmp_path, algorithm):
    """Offline preference training has no generation to overlap: refused at config load."""
    with pytest.raises(ValueError, match=rf"trainer\.off_policy='one_step' is not supported by the '{algorithm}'"):
        _config(tiny_example, tmp_path / "run", ("trainer.total_steps=1",), algorithm=algorithm)


def test_config_rejects_an_unknown_mode(tiny_example, tmp_path):
    with pytest.raises(Exception, match="off_policy"):
        _config(tiny_example, tmp_path / "run", ("trainer.off_policy=two_step",))


@pytest.mark.ray
def test_one_step_on_ray_with_separate_rollout_pool(tiny_example, tmp_path, ray_local):
    """The real overlap path: rollout and reward in their own Ray pool, the next generation in
    flight while the actor updates; staleness and the trace record which workers did it."""
    import os
    import socket

    pytest.importorskip("ray")
    out = tmp_path / "run"
    train_on_ray(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(out)) + QUICK + [
        "trainer.off_policy=one_step", "trainer.total_steps=3", "trainer.save_every=100",
        "trainer.backend=ray", "rollout.backend=hf",
        "ray.pools={default: {cpus_per_bundle: 1}, gen: {cpus_per_bundle: 1}}", "ray.roles={rollout: gen, reward: gen}",
    ], address=ray_local)
    metrics = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]  # step 1 on-policy, then one update old
    trace = read_jsonl(out / "trace.jsonl")
    rollout_pids = {s["rollout_pid"] for rec in trace for s in rec["samples"]}
    assert rollout_pids and os.getpid() not in rollout_pids  # generated in a Ray worker, not here
    assert {w["pid"] for w in trace[0]["workers"]["rollout"]} == rollout_pids
    rollout_hosts = {s["rollout_host"] for rec in trace for s in rec["samples"]}
    assert {w["host"] for w in trace[0]["workers"]["rollout"]} == rollout_hosts
    for role in ("actor", "reward"):  # Ray workers in other processes name their host too
        workers = trace[0]["workers"][role]
        assert workers and all(w["host"] == socket.gethostname() and w["pid"] != os.getpid() for w in workers), workers
