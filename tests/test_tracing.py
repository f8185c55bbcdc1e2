"""Tracing: every sample carries its uid and a request id from prompt to loss, the trainer knows
which rank of each group handled it, and trace.jsonl has one record per step."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.controller import Dispatch, MethodSpec
from rlcore.controller.dispatch import plan_dispatch
from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.output import rollout_output
from rlcore.trainer.tracing import dp_ranks as _dp_ranks


def _prompts(uids) -> Batch:
    b = len(uids)
    ids = torch.arange(b * 3).reshape(b, 3)
    return Batch(tensors={"input_ids": ids, "attention_mask": torch.ones(b, 3, dtype=torch.long)},
                 meta={"uid": np.array(uids, dtype=object)})


def _outputs(prompts: Batch, n: int) -> Batch:
    rows = len(prompts) * n
    return rollout_output(prompts, torch.ones(rows, 2, dtype=torch.long), torch.ones(rows, 2),
                          torch.zeros(rows, 2), SamplingParams(n=n))


def test_request_ids_are_uid_slash_sample_index_and_unique():
    out = _outputs(_prompts(["a-1", "b-7", "c-3"]), n=4)
    rid = out.meta["request_id"].tolist()
    assert rid[:5] == ["a-1/0", "a-1/1", "a-1/2", "a-1/3", "b-7/0"]
    assert len(set(rid)) == 12
    assert all(r.rsplit("/", 1)[0] == u for r, u in zip(rid, out.meta["uid"]))
    assert out.meta["rollout_pid"].tolist() == [os.getpid()] * 12


def test_request_ids_follow_samples_through_take_and_concat():
    """Reordering (balanced dispatch) and merging must keep ids attached to their rows."""
    out = _outputs(_prompts(["a", "b"]), n=3)
    out = out.union(Batch(tensors={"row": torch.arange(6)}))
    shuffled = Batch.concat([out.take(np.array([5, 0, 3])), out.take(np.array([1, 4, 2]))])
    for row, rid in zip(shuffled["row"].tolist(), shuffled.meta["request_id"]):
        assert rid == f"{'ab'[row // 3]}/{row % 3}"


def test_rows_without_uid_get_row_index_request_ids():
    prompts = Batch(tensors={"input_ids": torch.ones(2, 2, dtype=torch.long),
                             "attention_mask": torch.ones(2, 2, dtype=torch.long)})
    out = rollout_output(prompts, torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1), torch.zeros(4, 1),
                         SamplingParams(n=2))
    assert out.meta["request_id"].tolist() == ["0/0", "0/1", "1/0", "1/1"]


@pytest.mark.parametrize("dispatch", [Dispatch.DP_COMPUTE, Dispatch.DP_BALANCED])
@pytest.mark.parametrize("rows,ws", [(8, 2), (7, 2), (10, 3), (5, 1)])
def test_dp_ranks_match_what_dispatch_sends_each_rank(dispatch, rows, ws):
    gen = torch.Generator().manual_seed(rows * 10 + ws)
    lengths = torch.randint(1, 9, (rows,), generator=gen)
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    batch = Batch(tensors={"attention_mask": mask, "row": torch.arange(rows)})
    group = SimpleNamespace(methods={"m": MethodSpec(dispatch)}, world_size=ws)
    ranks = _dp_ranks(group, "m", rows, batch)

    # each rank answers with its own rank per row; collect puts the real rows back in order
    plan = plan_dispatch(dispatch, ws, (batch,), {}, method="m")
    results = [Batch(tensors={"rank": torch.full((len(args[0]),), rank)}) for rank, args, _ in plan.calls]
    assert ranks.tolist() == plan.collect(results)["rank"].tolist()


def test_dp_ranks_is_none_for_broadcast_methods():
    group = SimpleNamespace(methods={"m": MethodSpec(Dispatch.ONE_TO_ALL)}, world_size=2)
    assert _dp_ranks(group, "m", 4, None) is None


@pytest.mark.slow
def test_trace_jsonl_follows_every_sample_of_every_step(tiny_example, tmp_path):
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.tracking import read_jsonl
    from rlcore.trainer.run import make_trainer

    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.total_steps=2",
        "trainer.val_before_train=false", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.trace_samples=3", "trainer.trace_max_chars=16", SCORE_IN_PROCESS,
    ])
    history = make_trainer(cfg).fit()
    trace = read_jsonl(tmp_path / "run" / "trace.jsonl")
    assert [r["step"] for r in trace] == [1, 2]
    for rec, metrics in zip(trace, history):
        samples = rec["samples"]
        assert len(samples) == 8 * 4
        assert len({s["request_id"] for s in samples}) == 32
        assert all(s["request_id"].rsplit("/", 1)[0] == s["uid"] for s in samples)
        assert np.mean([s["reward"] for s in samples]) == pytest.approx(metrics["reward/mean"])
        assert np.mean([s["response_length"] for s in samples]) == pytest.approx(metrics["response_length/mean"])
        assert {s["rollout_rank"] for s in samples} == {0} and {s["actor_rank"] for s in samples} == {0}
        assert {s["rollout_pid"] for s in samples} == {os.getpid()}  # in-process: this process did the work
        assert rec["phases"]["generate"]["role"] == "rollout" and rec["phases"]["update_actor"]["role"] == "actor"
        assert rec["phases"]["update_actor"]["s"] == pytest.approx(metrics["time/update_actor_s"])
        assert rec["workers"]["actor"] == [{"rank": 0, "pid": os.getpid(), "host": samples[0]["rollout_host"]}]
        # trainer.trace_samples=3: three conversations (prompt and response, cut to trace_max_chars=16), the rest ids only
        texts = [s for s in samples if s.get("conversation")]
        assert len(texts) == 3 and all("response" not in s and "prompt" not in s for s in samples if s not in texts)
        for s in texts:
            assert s["prompt"][0]["role"] == "user" and isinstance(s["response"], str)
            assert len(s["response"]) <= 16 or s["response"][16:].startswith("... [")
