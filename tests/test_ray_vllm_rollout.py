"""Data-parallel vLLM rollout on Ray: two rollout ranks, each a Ray actor holding its own vLLM
engine (in its process, or at tensor parallel 2 an engine of two rank processes). Both generate a
share of every step, and both receive the actor's weights after each update: from step 2 on, each
engine's log-probs still equal the actor's."""

from __future__ import annotations

import importlib.util
import os

import pytest
from conftest import train_on_ray  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.tracking import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]
pytest.importorskip("ray")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)


@pytest.mark.parametrize("layout", ["rollout.world_size=2", "rollout.layout={data_parallel: 2, tensor_parallel: 2}"],
                         ids=["dp2", "dp2xtp2"])
def test_two_vllm_rollout_ranks_share_the_batch_and_both_get_the_weights(tiny_example, tmp_path, ray_local, layout):
    """dp2xtp2: two engines of tensor-parallel size 2 (four vLLM ranks; on a 2-core machine the
    engines' threads are not pinned, "nobind"), each getting the full tensors at every sync."""
    out = tmp_path / "run"
    train_on_ray(CONFIG_DIR / "tiny_grpo.yaml", [
        *tiny_example_overrides(tiny_example, str(out)),
        "trainer.backend=ray", "rollout.backend=vllm", layout, "rollout.vllm.kv_cache_gib=0.25",
        "trainer.total_steps=3", "trainer.save_every=100", "trainer.val_every=100", "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
    ], address=ray_local)

    trace = read_jsonl(out / "trace.jsonl")
    workers = trace[0]["workers"]["rollout"]
    assert [w["rank"] for w in workers] == [0, 1] and len({w["pid"] for w in workers}) == 2
    assert os.getpid() not in {w["pid"] for w in workers}
    for rec in trace:  # every step's prompts are split over both engines, each in its own process
        by_rank = {s["rollout_rank"]: set() for s in rec["samples"]}
        for s in rec["samples"]:
            by_rank[s["rollout_rank"]].add(s["rollout_pid"])
        assert by_rank == {0: {workers[0]["pid"]}, 1: {workers[1]["pid"]}}
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 0]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # log-probs of both engines match the updated actor: a rank left on old weights would not
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in metrics), [m["rollout/logprob_diff_max"] for m in metrics]
