"""The Ray cluster a run uses: start a local one or join one, and the addresses and network
interfaces it is reached on.

A local cluster that rlcore starts listens on 127.0.0.1 only and is watched by
`rlcore.controller.ray_reaper`; a cluster given by address is joined as it was started (one on a
loopback address is reached there). Also here: which interface holds an address (gloo's pairs on
loopback) and what the cluster's nodes are (for error messages and naming a lost node).
"""

from __future__ import annotations

import gc
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlcore.controller import ray_reaper

__all__ = [
    "LOOPBACK",
    "address_host",
    "describe_nodes",
    "effective_address",
    "ensure_ray",
    "interface_with",
    "is_loopback",
    "node_state",
]

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` is an address of this machine only (127.0.0.0/8, ::1, IPv4-mapped loopback)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def address_host(address: str) -> str:
    """The host of a Ray address ("host:port", "[::1]:port", "host"); "" for "auto" and ray:// URLs."""
    if address == "auto" or "://" in address:
        return ""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


@contextmanager
def _ray_node_ip_kept_local() -> Iterator[None]:
    """While a local Ray starts: let `_node_ip_address="127.0.0.1"` stand.

    On Linux Ray 2.60 replaces a loopback node address by the machine's routable one
    (`services.resolve_ip_for_localhost`, unless `ENABLE_RAY_CLUSTER` is off, as on macOS and
    Windows), and its GCS, raylet, agents and workers then listen on every interface. That switch
    is read when the address is resolved, not at import, so it is turned off here for the
    duration of `ray.init` only (a later connection to a real cluster is unaffected)."""
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: the check after ray.init still guards the result
        yield
        return
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _node_registered_on_loopback(address: str) -> bool | None:
    """Whether the cluster at `address` has a live node registered on 127.0.0.1, asked of its GCS
    (Ray's own client; None when this Ray has none or the GCS does not answer in 10 s)."""
    try:
        from ray._raylet import GcsClient

        nodes = GcsClient(address=address).get_all_node_info(timeout=10)
    except Exception:  # another Ray layout, or no answer: ensure_ray then tries both ways
        return None
    alive = [info for info in nodes.values() if info.state == 0]  # GcsNodeInfo.GcsNodeState.ALIVE
    return any(info.node_manager_address == LOOPBACK for info in alive)


def effective_address(address: str | None) -> str | None:
    """The cluster `ensure_ray` joins: `address`, else `RAY_ADDRESS` (what Ray sets for a job's
    driver); None: it starts a local Ray."""
    return address or os.environ.get("RAY_ADDRESS") or None


LOOPBACK_TRIES = 3  # how often ensure_ray asks, and tries, a cluster on a loopback address before giving up


def ensure_ray(address: str | None = None, num_cpus: float | None = None, temp_dir: str | None = None) -> bool:
    """Connect to `address`, or start a local cluster. Returns True when this call started Ray
    (the caller then owns `ray.shutdown()`); an already initialised Ray is reused as it is.

    A local cluster listens on 127.0.0.1 only (GCS, raylet, object manager, agents, workers; no
    dashboard): nothing of it is reachable from the network, and nothing of it outlives this
    process by more than a second or two, however this process ends (`_guard_local_ray`). A
    cluster given by `address` is used as it was started (one on a loopback address is reached
    there)."""
    import ray

    if ray.is_initialized():
        return False
    address = effective_address(address)
    if address and address.startswith(("http://", "https://")):
        raise ValueError(f"Ray address {address!r} is a dashboard (job server) URL; ray.address (and RAY_ADDRESS for "
                         "a run) takes the cluster's GCS address, host:port (`ray start --head --port`), or 'auto'")
    # Object and actor ids repeat across sessions of one process (same job id): a stale ObjectRef
    # from an earlier session, freed later by the cycle collector, would drop the count of a new
    # object or actor with the same id and kill it. Free such garbage before starting.
    gc.collect()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        if is_loopback(address_host(address)):
            # A cluster on a loopback address: its node is registered as 127.0.0.1 when it was
            # started with Ray's rewrite off (by rlcore in another process), and Ray would rewrite
            # this process's 127.0.0.1 to the routable address and never find it; a `ray start
            # --node-ip-address=127.0.0.1` head registers the routable address (Ray rewrote it
            # there), and a plain connection finds it. Only how this process connects changes.
            # The GCS says which it is; each wrong guess would cost Ray's 60 s search for the node.
            # A loaded machine can miss either bound once (the GCS's 10 s answer, Ray's own wait
            # for the node): ask again before guessing, and a node known to be on loopback is
            # only ever reached there (a plain connection would wait for it forever).
            on_loopback = None
            for _ in range(LOOPBACK_TRIES):
                on_loopback = _node_registered_on_loopback(address)
                if on_loopback is not None:
                    break
            if on_loopback is not False:
                failure: Exception | None = None
                for _ in range(LOOPBACK_TRIES if on_loopback else 1):
                    try:
                        with _ray_node_ip_kept_local():
                            ray.init(address=address, log_to_driver=True, _node_ip_address=LOOPBACK)
                        return True
                    except (ConnectionError, RuntimeError) as err:
                        ray.shutdown()
                        failure = err
                if on_loopback:
                    raise ConnectionError(f"could not join the Ray cluster at {address} (its node is on {LOOPBACK}) "
                                          f"in {LOOPBACK_TRIES} tries: {failure}")
        ray.init(address=address, log_to_driver=True)
        return True
    kwargs: dict[str, Any] = dict(include_dashboard=False, dashboard_host=LOOPBACK, log_to_driver=True,
                                  _node_ip_address=LOOPBACK)
    if num_cpus is not None:
        kwargs["num_cpus"] = int(-(-num_cpus // 1))
    if temp_dir:
        os.makedirs(temp_dir, exist_ok=True)
        kwargs["_temp_dir"] = os.path.abspath(temp_dir)
    before = ray_reaper.children_of(os.getpid()) if _CAN_GUARD else set()
    with _ray_node_ip_kept_local():
        ray.init(**kwargs)
    if _CAN_GUARD:
        _guard_local_ray(ray_reaper.children_of(os.getpid()) - before)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(
            f"the local Ray cluster came up on {node_ip}, not {LOOPBACK}: its services would be reachable from the "
            f"network. This Ray ({ray.__version__}) does not keep a local node on loopback the way rlcore asks it to; "
            "start a cluster yourself (`ray start --head ...`) and pass its address as ray.address")
    return True


_CAN_GUARD = sys.platform.startswith("linux")  # /proc, as the kernel fate-sharing Ray relies on
_GUARDS: list[subprocess.Popen] = []  # the watchers of this process's local Rays (their pipes stay open here)


def _guard_local_ray(roots: set[int]) -> None:
    """Start `rlcore.controller.ray_reaper` over the processes a local `ray.init` started (`roots`):
    should this process die without `ray.shutdown()` (SIGKILL, the OOM killer), it kills what
    Ray's own fate-sharing leaves running (the raylet's agents, for a minute or more)."""
    if not roots:
        return
    _GUARDS[:] = [g for g in _GUARDS if g.poll() is None]  # an earlier session's watcher exited with its Ray
    _GUARDS.append(subprocess.Popen(
        [sys.executable, "-I", ray_reaper.__file__, str(os.getpid()), *map(str, sorted(roots))],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def interface_with(addr: str) -> str | None:
    """The name of this machine's network interface that holds `addr` (`lo` for 127.0.0.1)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None

def describe_nodes() -> str:
    """The cluster's live nodes, one short entry each: id prefix, address, resources, labels."""
    import ray

    parts = []
    for node in ray.nodes():
        if node.get("Alive"):
            resources = {k: v for k, v in node.get("Resources", {}).items() if not k.startswith(("node:", "memory", "object_store"))}
            labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            parts.append(f"{node['NodeID'][:12]} at {node.get('NodeManagerAddress')} {resources}"
                         + (f" labels {labels}" if labels else ""))
    return "; ".join(parts) or "none"


def node_state(node_id: str) -> tuple[bool, str]:
    """Whether the node is alive, and how to name it: 'node <id prefix> (<host>, <ip>)'."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return bool(node.get("Alive")), (f"node {node_id[:12]} ({node.get('NodeManagerHostname')}, "
                                             f"{node.get('NodeManagerAddress')})")
    return False, f"node {node_id[:12]}"

