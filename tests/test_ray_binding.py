"""The local Ray cluster rlcore starts (`ensure_ray` without an address) listens on 127.0.0.1 only:
GCS, raylet, agents, the driver and the workers, and the TCP store and gloo pairs of a 2-rank
torch.distributed group on them. Sockets are read from the kernel (psutil) while the group runs.
A cluster given by address is used as it is (one on loopback is reached on loopback), and
outlives rlcore's connection to it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.controller import Dispatch, Worker, register
from rlcore.controller.ray_backend import RayWorkerGroup
from rlcore.controller.ray_cluster import address_host, ensure_ray, is_loopback
from rlcore.controller.ray_placement import ResourcePool

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
# These tests start their own Ray clusters (not the session's `ray_local`): what they judge is how
# rlcore starts a local cluster (its sockets) and how it joins one given by address.
pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]


class Gloo(Worker):
    """A rank of a 2-rank gloo group: a real collective over the rendezvous rlcore sets up."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self, x: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([x + self.rank])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def tree_pids() -> dict[int, str]:
    """This process and every process under it (the Ray cluster it started), with names."""
    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            out[p.pid] = " ".join(p.cmdline())[:120] or p.name()
        except psutil.Error:  # exited meanwhile
            pass
    return out


def listening(pids: dict[int, str]) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, process) of every listening TCP socket (IPv4 and IPv6) of `pids`."""
    return [(c.laddr.ip, c.laddr.port, c.pid, pids[c.pid]) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


@pytest.fixture
def ray_temp() -> Iterator[str]:
    temp = tempfile.mkdtemp(prefix="rlb", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_is_loopback():
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.3.0.9", "::1", "::ffff:127.0.0.1", "localhost"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "::", "192.0.2.2", "10.0.0.1", "::ffff:192.0.2.2", "example.org"))
    assert [address_host(a) for a in ("127.0.0.1:6379", "[::1]:6379", "10.1.2.3:6379", "auto", "ray://10.1.2.3:10001")] \
        == ["127.0.0.1", "::1", "10.1.2.3", "", ""]


@pytest.mark.distributed  # a 2-rank gloo group between the Ray workers
def test_local_cluster_and_distributed_workers_listen_on_loopback_only(ray_temp):
    assert not ray.is_initialized(), "another test left Ray running"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    # Sockets this test process already had (in the whole suite, an earlier test's one-process
    # torch.distributed store was seen listening on ::): not Ray's, so not what this test judges.
    before = {(ip, port) for ip, port, _, _ in listening(tree_pids())}
    assert ensure_ray(num_cpus=2, temp_dir=ray_temp) is True
    pool = group = None
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        pool = ResourcePool("bind", 2, cpus_per_bundle=1.0)
        group = RayWorkerGroup(lambda r, ws: Gloo(r, ws), 2, "gloo", pool=pool, distributed=True,
                               dist_backend="gloo", call_timeout_s=scaled(120), init_timeout_s=scaled(300))
        assert group.all_reduce(1.0) == [3.0, 3.0]  # (1+0) + (1+1) on both ranks: the group works
        workers = set(group.pid())
        pids = tree_pids()
        sockets = [s for s in listening(pids) if (s[0], s[1]) not in before]
        # the check saw what it must: Ray's own services and both ranks (rank 0: the TCP store)
        names = " ".join(pids[pid] for _, _, pid, _ in sockets)
        assert "gcs_server" in names and "raylet" in names, sockets
        assert workers <= {pid for _, _, pid, _ in sockets}, (workers, sockets)
        exposed = [s for s in sockets if not is_loopback(s[0])]
        assert exposed == [], "listening beyond loopback:\n" + "\n".join(map(str, exposed))
    finally:
        if group is not None:
            group.shutdown()
        if pool is not None:
            pool.remove()
        import gc

        gc.collect()  # stale refs of this session must not outlive it (ids repeat in the next one)
        ray.shutdown()


OWNER = textwrap.dedent("""
    import sys
    import ray
    from rlcore.controller.ray_cluster import ensure_ray

    assert ensure_ray(num_cpus=1, temp_dir=sys.argv[1])
    print(ray.get_runtime_context().gcs_address, ray.get_runtime_context().get_node_id(), flush=True)
    sys.stdin.readline()  # the test connects, works and disconnects meanwhile

    @ray.remote
    def ping() -> str:
        return "alive"

    print(ray.get(ping.remote(), timeout=float(sys.argv[2])), flush=True)
    ray.shutdown()
""")


def test_a_cluster_given_by_address_is_used_as_it_is(ray_temp, monkeypatch):
    """rlcore connects to it (returns True: the caller disconnects), changes nothing about it,
    and the cluster goes on working after the disconnect."""
    assert not ray.is_initialized(), "another test left Ray running"
    # Token authentication off on both sides, as everywhere in the suite: with it on (Ray's default
    # once ~/.ray/auth_token exists) this connection was refused as unauthenticated here and then
    # waited on the rewritten address; it passed only where an earlier test of the same worker had
    # already set RAY_AUTH_MODE=disabled (FIELD_NOTES, 2026-12-04).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, ray_temp, str(scaled(60))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = owner.stdout.readline().split()
        assert len(line) == 2, owner.stderr.read() if owner.poll() is not None else line
        address, node_id = line
        assert is_loopback(address.rsplit(":", 1)[0])
        assert ensure_ray(address=address) is True
        try:
            assert ray.get_runtime_context().gcs_address == address  # reached where it is, not via another address
            nodes = [n for n in ray.nodes() if n["Alive"]]
            assert [n["NodeID"] for n in nodes] == [node_id]  # the owner's node, no new one
            assert nodes[0]["NodeManagerAddress"] == "127.0.0.1"
            assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=scaled(60)) == 42
        finally:
            ray.shutdown()
        out, err = owner.communicate("\n", timeout=scaled(120))
        assert owner.returncode == 0 and out.strip() == "alive", err[-2000:]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def _ray_processes(root: int) -> dict[int, tuple[float, str]]:
    """Every process under `root` (not `root` itself): pid -> (start time, command line)."""
    found = {}
    for p in psutil.Process(root).children(recursive=True):
        try:
            found[p.pid] = (p.create_time(), " ".join(p.cmdline()).strip() or p.name())
        except psutil.Error:  # exited meanwhile
            pass
    return found


def _still_running(procs: dict[int, tuple[float, str]]) -> dict[int, str]:
    """Those of `procs` that still run (the same pid and start time; a zombie has ended)."""
    alive = {}
    for pid, (started, what) in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive[pid] = what
        except psutil.Error:
            pass
    return alive


@pytest.mark.timeout(900)
def test_a_sigkilled_rlcore_train_leaves_nothing_of_its_local_ray_running(tiny_example, ray_temp, tmp_path):
    """`rlcore train` on the local Ray it starts, SIGKILLed once its workers and Ray's agents run:
    every process of that Ray is gone within seconds (Ray alone left the dashboard and
    runtime-env agents running a minute or more: they first try to report their raylet's death to
    the GCS, killed with it). One run; it is killed before the model loads."""
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides

    args = [sys.executable, "-m", "rlcore.cli", "train", str(CONFIG_DIR / "tiny_grpo.yaml"),
            *tiny_example_overrides(tiny_example, str(tmp_path / "run")), "trainer.backend=ray",
            f"ray.temp_dir={ray_temp}", "trainer.total_steps=1000", "trainer.val_before_train=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    with open(tmp_path / "stderr.txt", "w") as log:
        run = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)
    procs: dict[int, tuple[float, str]] = {}
    try:
        wanted = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::_WorkerHost", "gcs_server", "raylet")
        deadline = time.monotonic() + scaled(600)
        while True:  # progress: every kind of process the run's Ray has, each started
            procs = _ray_processes(run.pid)
            if all(any(kind in what for _, what in procs.values()) for kind in wanted):
                break
            assert run.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the run's Ray did not start in 600 s: {[w[:150] for _, w in procs.values()]}"
            time.sleep(0.2)
        # The watcher notes the Ray's processes every POLL_S (1 s); one started since its last look is not
        # known to it. Give it a few looks (it scans /proc, slower on a loaded machine) before the kill.
        time.sleep(scaled(5))
        procs = _ray_processes(run.pid)
        run.kill()
        run.wait()
        deadline = time.monotonic() + scaled(30)  # seconds are enough (the watcher acts at once); a loaded machine
        while (left := _still_running(procs)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running 30 s after the SIGKILL: { {pid: what[:150] for pid, what in left.items()} }"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in _still_running(procs):  # a failed test leaves nothing behind
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
