"""Both cores busy: thread counts from the cores a process really has (`rlcore.cpus`), an
in-process worker group on a thread of its own and one in a child process (calls overlap the
caller's work, run one at a time in order, errors name role and method), and one-step GRPO runs
whose next generation really runs during this step's update, with the weight sync after it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore import cpus
from rlcore.controller import Dispatch, InProcessWorkerGroup, Worker, WorkerError, register


def _cgroup_tree(tmp_path: Path, v2: str | None = None, v1: tuple[int, int] | None = None) -> tuple[Path, Path]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup: the process in /job/step, a quota on /job."""
    root = tmp_path / "cgroup"
    lines = []
    if v2 is not None:
        (root / "job" / "step").mkdir(parents=True)
        (root / "job" / "cpu.max").write_text(v2 + "\n")
        (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
        lines.append("0::/job/step")
    if v1 is not None:
        folder = root / "cpu,cpuacct" / "job"
        folder.mkdir(parents=True)
        (folder / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (folder / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
        lines.append("3:cpu,cpuacct:/job")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("\n".join(lines) + "\n")
    return proc, root


def test_cgroup_quota_v2_and_v1_and_none(tmp_path):
    assert cpus.cgroup_cpu_limit(*_cgroup_tree(tmp_path / "a", v2="250000 100000")) == 2.5  # the parent's quota
    assert cpus.cgroup_cpu_limit(*_cgroup_tree(tmp_path / "b", v1=(300000, 100000))) == 3.0
    assert cpus.cgroup_cpu_limit(*_cgroup_tree(tmp_path / "c", v2="max 100000", v1=(-1, 100000))) is None
    assert cpus.cgroup_cpu_limit(tmp_path / "missing", tmp_path) is None


def test_threads_come_from_affinity_and_quota_unless_set_explicitly(monkeypatch):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.available_cpus() == 16 and cpus.intra_op_threads() == 16
    assert cpus.split_cores(2) == [8.0, 8.0] and cpus.intra_op_threads(0.5) == 1
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 6.5)  # a container's --cpus 6.5
    assert cpus.intra_op_threads() == 6 and cpus.split_cores(2) == [3.0, 3.0]
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # taskset -c 0-2
    assert cpus.intra_op_threads() == 3 and cpus.split_cores(2) == [2.0, 1.0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an explicit setting wins (./dev's default too)
    assert cpus.intra_op_threads() == 1 and cpus.intra_op_threads(8) == 1 and cpus.sized_threads() == 3


class _Probe(Worker):
    """Records which thread ran each call and its torch thread count; `wait` blocks on an event."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank, world_size)
        self.event = threading.Event()
        self.log: list[tuple[str, float, float]] = []

    def setup(self) -> None:
        self.setup_thread = threading.get_ident()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def wait(self, timeout: float) -> int:
        start = time.monotonic()
        if not self.event.wait(timeout):
            raise TimeoutError("nobody released me")
        self.log.append(("wait", start, time.monotonic()))
        return threading.get_ident()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def release(self) -> None:
        self.event.set()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def echo(self, value: torch.Tensor) -> torch.Tensor:
        return value

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def record(self) -> tuple[int, int]:
        self.log.append(("record", time.monotonic(), time.monotonic()))
        return threading.get_ident(), torch.get_num_threads()


def test_a_group_on_its_own_thread_overlaps_the_caller_and_keeps_call_order(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    group = InProcessWorkerGroup(_Probe, role="rollout", own_thread=True, cores=1)
    try:
        worker = group.workers[0]
        assert worker.setup_thread != threading.get_ident()  # built and set up there
        pending = group.call_async("wait", scaled(30.0))  # returns at once: the worker blocks on its own thread
        after = group.call_async("record")         # queued behind it
        worker.event.set()                          # the caller is free to act meanwhile
        ident = pending.result()[0]
        assert ident == worker.setup_thread != threading.get_ident()
        assert after.result()[0] == (ident, 1)
        assert [name for name, *_ in worker.log] == ["wait", "record"] and worker.log[0][2] <= worker.log[1][1]
        with pytest.raises(WorkerError, match=r"rollout.*wait.*TimeoutError"):
            worker.event.clear()
            group.call("wait", 0.01)
    finally:
        group.shutdown()
    assert group._thread is not None and group._thread._shutdown


class _CallsBack(_Probe):
    """A method that calls back into its own group (an async weight sync run between two decode steps)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def call_back(self) -> tuple[int, int]:
        return threading.get_ident(), self.group.call("record")[0][0]


def test_a_call_back_into_the_group_from_its_own_thread_runs_there_without_waiting_for_itself():
    group = InProcessWorkerGroup(_CallsBack, role="rollout", own_thread=True, cores=1)
    try:
        worker = group.workers[0]
        worker.group = group
        outer, inner = group.call_async("call_back").result()[0]
        assert outer == inner == worker.setup_thread != threading.get_ident()
        assert group.call("record")[0][0] == worker.setup_thread  # from outside: still on its thread
    finally:
        group.shutdown()


def test_the_groups_thread_keeps_its_own_torch_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "available_cpus", lambda: 2.0)
    before = torch.get_num_threads()
    group = InProcessWorkerGroup(_Probe, role="rollout", own_thread=True, cores=1)
    try:
        cpus.use_cores(2)  # the training thread takes its share after the group's thread set its own
        assert group.call("record")[0][1] == 1 and torch.get_num_threads() == 2
    finally:
        group.shutdown()
        torch._C.set_num_threads(before)


def test_thread_sizing_survives_vllms_patch(monkeypatch):
    """An in-process vLLM CPU engine replaces `torch.set_num_threads` with a no-op for the whole
    process once it starts (seen in a whole-suite run: the sizing was silently lost); the sizing
    still sets the thread's count."""
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's cpu_worker does
    try:
        assert cpus.use_cores(threads=2) == 2 and torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_workers_size_torch_threads_from_their_bundle(monkeypatch, ray_driver):
    """OMP_NUM_THREADS unset: two workers sharing a 2-CPU bundle run 1 torch thread each, one
    worker with a 2-CPU bundle to itself runs 2; with it set, every worker runs that many. (The
    driver decides: a worker's thread count and environment come from this process, not from
    the cluster's.)"""
    import sys

    ray = pytest.importorskip("ray")
    from rlcore.controller import RayWorkerGroup, ResourcePool

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    shared, alone = ResourcePool("shared", 1, 2.0, 0.0, "PACK"), ResourcePool("alone", 1, 2.0, 0.0, "PACK")
    groups = [RayWorkerGroup(_Probe, 1, f"half{i}", pool=shared, share=0.5) for i in range(2)]
    groups.append(RayWorkerGroup(_Probe, 1, "whole", pool=alone))
    assert [g.call("record")[0][1] for g in groups] == [1, 1, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    groups[2].shutdown()
    explicit = RayWorkerGroup(_Probe, 1, "explicit", pool=alone)
    assert explicit.call("record")[0][1] == 1
    for g in [*groups, explicit]:
        g.shutdown()


@pytest.mark.slow
def test_one_step_in_process_generates_the_next_batch_during_the_update(tiny_example, tmp_path):
    """Step 2's generation waits (on the rollout thread) until step 1's update has started: only
    possible when the two run at once. Weight syncs never run during a generation."""
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.trainer.run import make_trainer

    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=3",
        "trainer.save_every=100", "trainer.val_before_train=false", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.off_policy=one_step", SCORE_IN_PROCESS])
    assert cfg.trainer.overlap_with == "thread"  # the default: its worker can be watched here
    trainer = make_trainer(cfg)
    actor, rollout = trainer.groups.actor.workers[0], trainer.groups.rollout.workers[0]
    update_started = [threading.Event() for _ in range(4)]
    spans: list[tuple[str, float, float, int]] = []

    def spy(worker, name, before=None):
        original = getattr(worker, name)

        def wrapped(*args, **kwargs):
            if before is not None:
                before()
            start = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                spans.append((name, start, time.monotonic(), threading.get_ident()))
        setattr(worker, name, wrapped)

    generations = iter(range(10))

    def hold_second_generation():
        if next(generations) == 1:  # step 2's batch, launched during step 1
            assert update_started[1].wait(scaled(60)), "step 2's generation never overlapped step 1's update"

    updates = iter(range(1, 10))
    spy(rollout, "generate_sequences", hold_second_generation)
    spy(actor, "update_actor", lambda: update_started[next(updates)].set())
    spy(rollout, "update_weights")
    history = trainer.fit()

    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0]
    gens = [s for s in spans if s[0] == "generate_sequences"]
    syncs = [s for s in spans if s[0] == "update_weights"]
    update_1 = [s for s in spans if s[0] == "update_actor"][0]
    assert gens[1][1] < update_1[2] and update_1[1] < gens[1][2]  # they overlapped
    assert {s[3] for s in gens} == {s[3] for s in syncs} != {update_1[3]}  # rollout thread vs this one
    assert not any(g[1] < w[2] and w[1] < g[2] for g in gens for w in syncs)  # no weights changed mid-generation


def test_one_step_refuses_a_sleeping_engine_and_never_sleeps_it_by_default(tmp_path):
    from rlcore.config import config_from_dict
    from rlcore.trainer.rollout_parts import rollout_shares_gpu

    tree = {"model": {"path": "m"}, "data": {"train_files": ["t"]}, "trainer": {"off_policy": "one_step", "device": "cuda"}}
    assert rollout_shares_gpu(config_from_dict(tree)) is False  # in process on a GPU it would sleep in sync mode
    for rollout in ({"sleep": "always"}, {"free_memory_when_idle": True}):  # the key, and its older spelling
        with pytest.raises(ValueError, match=r"rollout\.sleep=always with trainer\.off_policy=one_step"):
            config_from_dict({**tree, "rollout": rollout})


@pytest.mark.parametrize("trainer,message", [
    ({"off_policy": "sync"}, r"trainer\.overlap_with=process with trainer\.off_policy=sync: nothing generates beside"),
    ({"off_policy": "one_step", "backend": "ray"}, r"trainer\.overlap_with=process with trainer\.backend=ray: the rollout "
     r"workers are Ray processes"),
    ({"off_policy": "async", "backend": "ray"}, r"trainer\.overlap_with=process with trainer\.off_policy=async: .*\(on Ray it sends"),
])
def test_overlap_with_is_refused_where_it_would_place_nothing(trainer, message):
    """`trainer.overlap_with` places the in-process rollout of a one_step run; elsewhere it would be
    ignored, so it is refused naming the key (the in-process one_step run takes it: test above)."""
    from rlcore.config import config_from_dict

    tree = {"model": {"path": "m"}, "data": {"train_files": ["t"]}}
    config_from_dict({**tree, "trainer": {"off_policy": "one_step", "overlap_with": "process"}})
    with pytest.raises(ValueError, match=message):
        config_from_dict({**tree, "trainer": {**trainer, "overlap_with": "process"}})


@pytest.mark.slow  # a child process: ~4 s to start torch
def test_a_group_in_a_child_process_runs_calls_in_order_and_reports_errors(monkeypatch):
    import functools
    import os

    from rlcore.controller.subprocess_group import SubprocessWorkerGroup

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    group = SubprocessWorkerGroup(functools.partial(_Probe), role="rollout", cores=1)
    try:
        assert group.pids()[0] != os.getpid()
        waiting = group.call_async("wait", 0.5)  # released only by a later call: times out
        recorded = group.call_async("record")
        group.call("release")  # queued behind both: the child runs calls in order, so this never comes first
        with pytest.raises(WorkerError, match=r"rollout.*wait.*TimeoutError: nobody released me"):
            waiting.result()
        assert recorded.result()[0][1] == 1  # its torch threads
        big = group.call("echo", torch.arange(1_000_000))  # bigger than the pipe's buffer both ways
        assert torch.equal(big[0], torch.arange(1_000_000))
    finally:
        group.shutdown()
    assert not group._proc.is_alive()


@pytest.mark.slow
def test_one_step_in_process_generates_in_a_child_process(tiny_example, tmp_path):
    import os

    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.tracking import read_jsonl
    from rlcore.trainer.run import make_trainer

    out = tmp_path / "run"
    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(out)) + [
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=3",
        "trainer.save_every=100", "trainer.val_before_train=false", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.off_policy=one_step", "trainer.overlap_with=process", SCORE_IN_PROCESS])
    history = make_trainer(cfg).fit()
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0]
    pids = {s["rollout_pid"] for rec in read_jsonl(out / "trace.jsonl") for s in rec["samples"]}
    assert len(pids) == 1 and os.getpid() not in pids
