"""Worker groups: dispatch modes, result order, padding, balancing, errors, colocation."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch

from rlcore.controller import (
    ColocatedWorker,
    Dispatch,
    GroupFuture,
    InProcessWorkerGroup,
    Worker,
    WorkerError,
    balanced_partitions,
    register,
)
from rlcore.controller.dispatch import _greedy_partitions
from rlcore.protocol import Batch


class ToyWorker(Worker):
    """Records what each rank received; outputs depend only on the rows, never on the rank."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.received: list[Batch] = []
        self.calls = 0
        self.ready = False
        self.closed = False

    def setup(self) -> None:
        self.ready = True

    def shutdown(self) -> None:
        self.closed = True

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch: Batch, scale: float = 1.0) -> Batch:
        self.received.append(batch)
        s = batch["input_ids"].float().sum(-1) * scale
        return Batch(tensors={"score": s}, meta={"uid": batch["uid"]}, info={"rank": self.rank})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def pair(self, a: Batch, b: Batch | None = None) -> Batch:
        return Batch(tensors={"sum": a["x"] + b["y"]})

    @register(dispatch=Dispatch.DP_BALANCED)
    def generate(self, batch: Batch, n: int = 1) -> Batch:
        self.received.append(batch)
        out = batch.repeat_interleave(n)
        out["sample"] = np.tile(np.arange(n), len(batch))
        out["tokens"] = out["attention_mask"].sum(-1)
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict:
        return {"rank": self.rank, "rows": len(batch)}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def consume(self, batch: Batch) -> None:
        self.received.append(batch)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str) -> tuple[int, str]:
        self.calls += 1
        return self.rank, tag

    @register(dispatch=Dispatch.RANK_ZERO)
    def save(self, path: str) -> str:
        self.calls += 1
        return f"{path}@{self.rank}"

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def start(self) -> int:
        return self.rank * 10

    @register(dispatch=Dispatch.DP_COMPUTE)
    def fail_on(self, batch: Batch, bad_rank: int) -> Batch:
        if self.rank == bad_rank:
            raise ValueError(f"boom on rank {self.rank} with {len(batch)} rows")
        return batch

    def helper(self) -> None:  # not registered: not callable through a group
        pass


def group(world_size: int, role: str = "toy") -> InProcessWorkerGroup:
    return InProcessWorkerGroup(lambda r, w: ToyWorker(r, w), world_size=world_size, role=role)


def prompts(n: int, width: int = 6, lengths: list[int] | None = None) -> Batch:
    lengths = lengths or [1 + (i * 5) % width for i in range(n)]
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, L in enumerate(lengths):
        mask[i, width - L:] = 1  # left-padded prompts
    return Batch(
        tensors={"input_ids": torch.arange(n * width).reshape(n, width) * mask, "attention_mask": mask},
        meta={"uid": [f"p{i}" for i in range(n)]},
    )


# ----- setup, registration ------------------------------------------------------------------


def test_setup_runs_on_every_rank_and_role_is_filled_in():
    wg = group(3)
    assert wg.world_size == 3 and wg.role == "toy"
    assert all(w.ready and w.role == "toy" for w in wg.workers)
    assert [w.rank for w in wg.workers] == [0, 1, 2]


def test_unregistered_method_is_an_error_listing_registered_ones():
    wg = group(1)
    with pytest.raises(AttributeError, match=r"no registered method 'helper'.*'score'"):
        wg.helper()
    with pytest.raises(AttributeError, match="'nope'"):
        wg.call("nope")


def test_factory_building_the_wrong_rank_is_an_error():
    with pytest.raises(ValueError, match="built rank 0/2 when asked for rank 1/2"):
        InProcessWorkerGroup(lambda r, w: ToyWorker(0, w), world_size=2, role="toy")


# ----- DP_COMPUTE -------------------------------------------------------------------------


def test_dp_compute_world_3_batch_7_equals_world_1():
    b = prompts(7)
    one, three = group(1), group(3)
    ref = one.score(b, scale=2.0)
    out = three.score(b, scale=2.0)
    assert len(out) == 7 and out.equal(ref)
    assert out["uid"].tolist() == [f"p{i}" for i in range(7)]
    expected = (b["input_ids"].float().sum(-1) * 2.0)
    assert torch.equal(out["score"], expected)
    # padded to 9 -> 3 rows per rank; the pad rows are copies of rows 0 and 1 on the last rank
    assert [len(w.received[0]) for w in three.workers] == [3, 3, 3]
    assert three.workers[2].received[0]["uid"].tolist() == ["p6", "p0", "p1"]
    assert out.info == {"rank": 0}


def test_dp_compute_without_padding_gives_contiguous_parts():
    wg = group(2)
    wg.consume(prompts(4))
    assert [w.received[0]["uid"].tolist() for w in wg.workers] == [["p0", "p1"], ["p2", "p3"]]


def test_dp_compute_splits_positional_and_keyword_batches_together():
    wg = group(3)
    a = Batch(tensors={"x": torch.arange(5)})
    b = Batch(tensors={"y": torch.arange(5) * 100})
    assert wg.pair(a, b=b)["sum"].tolist() == [0, 101, 202, 303, 404]
    with pytest.raises(ValueError, match="argument 'b' has 4 rows, the first Batch has 5"):
        wg.pair(a, b=Batch(tensors={"y": torch.arange(4)}))
    with pytest.raises(TypeError, match="needs a Batch argument"):
        wg.call("pair", 1, b=2)


def test_dp_non_batch_results_come_back_per_rank_and_none_as_none():
    wg = group(2)
    assert wg.update(prompts(5)) == [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]
    assert wg.consume(prompts(2)) is None


# ----- DP_BALANCED --------------------------------------------------------------------------


def test_dp_balanced_equalises_tokens_and_restores_order():
    lengths = list(range(1, 13))  # sorted: contiguous parts would get 10, 26 and 42 tokens
    b = prompts(12, width=12, lengths=lengths)
    wg = group(3)
    out = wg.generate(b)
    totals = [int(w.received[0]["attention_mask"].sum()) for w in wg.workers]
    assert sum(totals) == 78 and max(totals) - min(totals) <= 3
    assert [len(w.received[0]) for w in wg.workers] == [4, 4, 4]
    assert out["uid"].tolist() == [f"p{i}" for i in range(12)]
    assert out["tokens"].tolist() == lengths
    assert out.equal(group(1).generate(b))


def test_dp_balanced_with_padding_and_n_samples_per_row():
    b = prompts(7, width=8, lengths=[8, 1, 7, 2, 6, 3, 5])
    out = group(3).generate(b, n=2)
    assert len(out) == 14
    assert out["uid"].tolist() == [f"p{i}" for i in range(7) for _ in range(2)]
    assert out["sample"].tolist() == [0, 1] * 7
    assert out["tokens"].tolist() == [L for L in [8, 1, 7, 2, 6, 3, 5] for _ in range(2)]
    assert torch.equal(out["input_ids"], b["input_ids"].repeat_interleave(2, dim=0))


def test_dp_balanced_needs_an_attention_mask():
    with pytest.raises(KeyError, match="attention_mask"):
        group(2).generate(Batch(tensors={"input_ids": torch.zeros(4, 3)}))


def test_greedy_fallback_partitions_are_equal_size_and_balanced(monkeypatch):
    lengths = np.arange(1, 13)
    parts = _greedy_partitions(lengths, 3)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert [int(lengths[p].sum()) for p in parts] == [26, 26, 26]
    monkeypatch.setitem(sys.modules, "rlcore.packing", None)  # force the fallback
    parts = balanced_partitions(np.array([9, 1, 1, 1, 5, 5]), 2)
    assert sorted(int(np.array([9, 1, 1, 1, 5, 5])[p].sum()) for p in parts) == [11, 11]


def test_balanced_partitions_cover_every_index_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, size=24)
    parts = balanced_partitions(lengths, 4)
    assert len(parts) == 4 and [len(p) for p in parts] == [6, 6, 6, 6]
    assert sorted(np.concatenate(parts).tolist()) == list(range(24))
    sums = [int(lengths[p].sum()) for p in parts]
    assert max(sums) - min(sums) <= lengths.max()


# ----- ONE_TO_ALL, RANK_ZERO, futures ------------------------------------------------------


def test_one_to_all_gives_per_rank_results_and_rank_zero_only_calls_rank_0():
    wg = group(3)
    assert wg.whoami("t") == [(0, "t"), (1, "t"), (2, "t")]
    assert wg.save("/ckpt") == "/ckpt@0"
    assert [w.calls for w in wg.workers] == [2, 1, 1]


def test_non_blocking_returns_a_future_and_call_async_always_does():
    wg = group(2)
    fut = wg.start()
    assert isinstance(fut, GroupFuture) and fut.result() == [0, 10]
    fut = wg.call_async("whoami", "x")
    assert fut.result() == [(0, "x"), (1, "x")]


# ----- errors ----------------------------------------------------------------------------


def test_worker_error_names_role_rank_method_and_carries_traceback():
    wg = group(3, role="actor")
    with pytest.raises(WorkerError) as info:
        wg.fail_on(prompts(7), bad_rank=2)
    err = info.value
    msg = str(err)
    assert "role='actor'" in msg and "rank=2" in msg and "method='fail_on'" in msg
    assert "ValueError: boom on rank 2 with 3 rows" in msg
    assert "Traceback (most recent call last)" in msg and "in fail_on" in msg
    assert (err.role, err.rank, err.method) == ("actor", 2, "fail_on")
    assert isinstance(err.__cause__, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == msg and again.rank == 2


def test_async_failure_surfaces_on_result():
    fut = group(2, role="critic").call_async("fail_on", prompts(4), bad_rank=0)
    with pytest.raises(WorkerError, match="role='critic' rank=0 method='fail_on'"):
        fut.result()


def test_failure_in_setup_is_a_worker_error():
    class Broken(Worker):
        def setup(self) -> None:
            raise RuntimeError("no model file")

    with pytest.raises(WorkerError, match=r"role='reward' rank=1 method='setup'.*no model file"):
        InProcessWorkerGroup(lambda r, w: Broken(r, w) if r else Worker(r, w), 2, role="reward")


def test_shutdown_reaches_workers_and_blocks_later_calls():
    with group(2) as wg:
        workers = wg.workers
    assert all(w.closed for w in workers)
    with pytest.raises(RuntimeError, match="shut down"):
        wg.whoami("x")
    wg.shutdown()  # twice is fine


# ----- colocation --------------------------------------------------------------------------


class RefWorker(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch: Batch) -> Batch:
        return Batch(tensors={"ref": -batch["input_ids"].float().sum(-1)})

    @register(dispatch=Dispatch.RANK_ZERO)
    def crash(self) -> None:
        raise KeyError("ref weights")


def colocated_group(world_size: int) -> InProcessWorkerGroup:
    def make(rank: int, ws: int) -> ColocatedWorker:
        return ColocatedWorker({"actor": ToyWorker(rank, ws), "ref": RefWorker(rank, ws)}, rank, ws)

    return InProcessWorkerGroup(make, world_size, role="actor_ref")


def test_colocated_roles_dispatch_by_their_own_registration():
    wg = colocated_group(2)
    b = prompts(5)
    assert wg.call("actor.score", b).equal(group(1).score(b))
    ref = wg.view("ref").score(b)
    assert torch.equal(ref["ref"], -b["input_ids"].float().sum(-1))
    assert wg.view("actor").whoami("q") == [(0, "q"), (1, "q")]
    assert all(w.workers["actor"].ready for w in wg.workers)
    assert "actor.score" in wg.methods and "ref.crash" in wg.methods
    with pytest.raises(AttributeError, match="no colocated role 'critic'"):
        wg.view("critic")
    with pytest.raises(WorkerError, match=r"role='actor_ref' rank=0 method='ref.crash'.*ref weights"):
        wg.view("ref").crash()


def test_bare_register_means_one_to_all_and_inconsistent_dp_rows_are_an_error():
    class Odd(Worker):
        @register
        def ping(self) -> int:
            return self.rank

        @register(dispatch=Dispatch.DP_COMPUTE)
        def shrink(self, batch: Batch) -> Batch:
            return batch.take([0]) if self.rank == 0 else batch

    wg = InProcessWorkerGroup(lambda r, w: Odd(r, w), 2, role="odd")
    assert wg.methods["ping"].dispatch is Dispatch.ONE_TO_ALL and wg.ping() == [0, 1]
    with pytest.raises(ValueError, match=r"shrink: ranks returned \[1, 2\] rows for inputs of \[2, 2\]"):
        wg.shrink(prompts(4))
