"""A multi-node Ray cluster on 127.0.0.1 for tests: `ray.cluster_utils.Cluster` (a head node with
the dashboard and job server, and worker nodes, each its own raylet), run in a process of its own
so that the test process never joins Ray itself.

`LocalCluster` starts it and talks to it over the host's stdin/stdout (one JSON line each way):
add a node, and read each node's id and raylet pid; a test kills a node by SIGKILL to its raylet,
as when a machine drops off the network. The nodes' processes (raylets, workers, a job's driver)
inherit the host's environment: PYTHONPATH to this worktree, one torch thread, no token auth, the
node address kept on loopback (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, see shared/FIELD_NOTES.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from net import free_port  # tests/ is on sys.path (pytest's rootdir conftest; this script's folder)
from timing import scaled

ROOT = Path(__file__).resolve().parents[1]


def cluster_env(temp_dir: str) -> dict[str, str]:
    """What every process of the test cluster runs with (and a driver connecting to it)."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),  # `python` = this environment's
        RAY_TMPDIR=temp_dir,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # nodes register as 127.0.0.1, not the routable address
        RAY_AUTH_MODE="disabled",  # the token file in the shared home may be replaced by another Ray here
        RAY_USAGE_STATS_ENABLED="0",
        RAY_agent_register_timeout_ms=str(round(scaled(300_000))),  # agents start slowly on a loaded 2-core machine
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    return env


class LocalCluster:
    """The host process and what it reported: `gcs_address` (ray.address), `dashboard_url` (the job
    server), `nodes` ({node_id: {"raylet_pid", "labels", "resources", "head"}})."""

    def __init__(self, head: dict[str, Any], workers: list[dict[str, Any]]):
        self.temp_dir = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # short: socket paths must fit 107 bytes
        self.env = cluster_env(self.temp_dir)
        self.log_path = Path(self.temp_dir) / "host.log"
        self._log = open(self.log_path, "w")
        spec = {"head": {**head, "dashboard_port": free_port()}, "workers": workers, "temp_dir": self.temp_dir}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=self.env,
                                     start_new_session=True)
        try:
            started = self._reply(timeout=480)
        except BaseException:
            self.stop()
            raise
        self.gcs_address: str = started["gcs_address"]
        self.dashboard_url: str = started["dashboard_url"]
        self.nodes: dict[str, dict[str, Any]] = {n["node_id"]: n for n in started["nodes"]}

    def _reply(self, timeout: float) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        bound = scaled(timeout)
        deadline = time.monotonic() + bound
        while True:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"the test cluster did not answer in {bound:.0f}s: see {self.log_path}")
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the test cluster's host exited ({self.proc.wait()}): "
                                     f"{self.log_path.read_text()[-3000:]}")
            if line.startswith("{"):
                reply = json.loads(line)
                if "error" in reply:
                    raise AssertionError(f"the test cluster: {reply['error']}")
                return reply

    def add_node(self, num_cpus: float = 1, labels: dict[str, str] | None = None,
                 resources: dict[str, float] | None = None) -> str:
        """A new worker node (a replacement, say); returns its node id once it has registered."""
        self.proc.stdin.write(json.dumps({"op": "add_node", "node": {"num_cpus": num_cpus, "labels": labels or {},
                                                                      "resources": resources or {}}}) + "\n")
        self.proc.stdin.flush()
        node = self._reply(timeout=360)  # registration may take minutes under load (_patient_node_registration)
        self.nodes[node["node_id"]] = node
        return node["node_id"]

    def kill_node(self, node_id: str) -> None:
        """SIGKILL the node's raylet: the node is lost, its workers die with it (the GCS notices
        when its health checks stop being answered)."""
        node = self.nodes.pop(node_id)
        os.kill(node["raylet_pid"], signal.SIGKILL)

    def dashboard_logs(self, tail: int = 3000) -> str:
        """The end of the job server's and the nodes' agents' logs (for a failing test's message)."""
        logs = Path(self.temp_dir) / "session_latest" / "logs"
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in
                         sorted(logs.glob("dashboard_JobHead.log")) + sorted(logs.glob("dashboard_agent*.log")))

    def nodes_with(self, **labels: str) -> list[str]:
        return [nid for nid, n in self.nodes.items() if all(n["labels"].get(k) == v for k, v in labels.items())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=scaled(60))
            except (OSError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever of the cluster is left (its process group)
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        self._log.close()
        if not os.environ.get("RLCORE_KEEP_TEST_CLUSTER_LOGS"):  # set it to read the nodes' logs afterwards
            shutil.rmtree(self.temp_dir, ignore_errors=True)


# ----- the host process -------------------------------------------------------------------------


def _describe(node: Any, spec: dict[str, Any], head: bool) -> dict[str, Any]:
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    return {"node_id": node.node_id, "raylet_pid": raylet.pid, "labels": spec.get("labels", {}),
            "resources": spec.get("resources", {}), "head": head}


def _node_args(spec: dict[str, Any], temp_dir: str) -> dict[str, Any]:
    # each node's dashboard agent on a free port: Ray's default (52365) is taken by any other Ray on
    # the machine (the shared `ray_local`), and a head whose agent cannot listen runs no job
    return {"num_cpus": spec.get("num_cpus", 1), "resources": spec.get("resources") or None,
            "labels": spec.get("labels") or None, "node_ip_address": "127.0.0.1", "temp_dir": temp_dir,
            "dashboard_agent_listen_port": free_port()}


def _patient_node_registration(timeout_s: float = 300.0) -> None:
    """Ray gives a starting node a fixed 30 s to register with the GCS (ray/_private/node.py polls
    `services.get_node`), which a loaded 2-core machine misses, leaving a half-started node behind:
    in this host process each of those polls waits up to `timeout_s` instead."""
    from ray._private import services

    original = services.get_node

    def get_node(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:  # not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node


def _host(spec: dict[str, Any]) -> None:
    from ray.cluster_utils import Cluster

    _patient_node_registration()
    temp_dir = spec["temp_dir"]
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)  # Ray writes its address file there (RAY_TMPDIR)
    head = spec["head"]
    cluster = Cluster(initialize_head=True, head_node_args={
        **_node_args(head, temp_dir), "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": head["dashboard_port"]})
    # What `ray start --head` writes and a Ray job's driver reads to find its cluster (RAY_ADDRESS
    # there); without it Ray falls back to any GCS process it sees on the machine: another's.
    from ray._private.utils import write_ray_address

    write_ray_address(cluster.address, temp_dir)
    nodes = [_describe(cluster.head_node, head, True)]
    for worker in spec["workers"]:
        nodes.append(_describe(cluster.add_node(**_node_args(worker, temp_dir)), worker, False))
    _wait_for_job_server(head["dashboard_port"])
    print(json.dumps({"gcs_address": cluster.address, "dashboard_url": f"http://127.0.0.1:{head['dashboard_port']}",
                      "nodes": nodes}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            node = cluster.add_node(**_node_args(cmd["node"], temp_dir))
            print(json.dumps(_describe(node, cmd["node"], False)), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    cluster.shutdown()


def _wait_for_job_server(port: int, timeout: float = 180.0) -> None:
    """The job server runs a first job (its head node's agent found and remembered: it starts after
    the head's raylet, slowly on a loaded machine)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    bound = scaled(timeout)
    deadline = time.monotonic() + bound
    while True:
        try:
            client = JobSubmissionClient(f"http://127.0.0.1:{port}")
            job = client.submit_job(entrypoint="true")
            while not (status := client.get_job_status(job)).is_terminal():
                time.sleep(0.2)
            if status == JobStatus.SUCCEEDED:
                return
        except (ConnectionError, RuntimeError):  # not up yet, or "no available agent ... try again later"
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the dashboard's job server on port {port} ran no job in {bound:.0f}s")
        time.sleep(1.0)


if __name__ == "__main__":
    _host(json.loads(sys.argv[1]))
