"""`RayWorkerGroup`: the worker-group interface with each rank in its own Ray actor.

Planning and collecting are shared with the in-process backend (`plan_dispatch`); this module
only starts per-rank calls (`execute.remote`) and waits for them. What it adds:

- placement: a `ResourcePool` is a placement group of `n` bundles; rank r of every group on the
  pool runs on bundle r, taking `share` of that bundle (several groups, or one group of
  colocated roles via `ColocatedWorker`, can live on one pool);
- futures that travel: a rank-zero/collective result passed to another group's call goes over
  as an ObjectRef, worker to worker, without being fetched into the controller;
- placement across nodes: a pool's strategy spreads its bundles over a cluster's nodes, and its
  custom resources and label selector pick which nodes (`ray.pools.*`); each rank reports the node
  it runs on (`identities()`);
- failures: a worker that raises becomes `WorkerError` (role, rank, method, remote traceback);
  a worker process that dies becomes `WorkerDiedError` as soon as Ray notices, naming the node it
  ran on and whether that node was lost, and a call that runs past `call_timeout_s` becomes
  `WorkerTimeoutError`: never an unbounded wait;
- torch.distributed: with `distributed=True` the ranks rendezvous (rank 0's node address and a
  free port it picks) before `setup()`, gloo on CPU, nccl with GPUs.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rlcore.controller import ray_reaper
from rlcore.controller.dispatch import Dispatch, MethodSpec
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import GroupFuture, WorkerGroup
from rlcore.controller.worker import Worker
from rlcore.cpus import explicit_threads, sized_threads, use_cores
from rlcore.errors import RLCoreError

__all__ = [
    "PlacementError",
    "PoolDemand",
    "RayGroupFuture",
    "RayWorkerGroup",
    "ResourcePool",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "address_host",
    "bundle_of",
    "check_placement",
    "effective_address",
    "ensure_ray",
    "interface_with",
    "is_loopback",
]

log = logging.getLogger(__name__)

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def worker_threads(cpus: float) -> tuple[int | None, dict[str, str]]:
    """A worker's torch threads: the driver's explicit `OMP_NUM_THREADS` (None when unset: the
    worker sizes them from `cpus`, its share of the bundle, capped by the cores it has), and the
    OpenMP/MKL environment it starts with (the same number, so libraries read no other default;
    oversubscribed threads cost 10-60x on shared cores)."""
    explicit = explicit_threads()
    n = explicit if explicit is not None else max(1, math.floor(cpus))
    return explicit, {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


class WorkerDiedError(WorkerError):
    """The worker process is gone (killed, out of memory, node lost). `node_id` is the Ray node it
    ran on (None when it died before reporting it) and `node_lost` whether that node is gone too."""

    def __init__(self, role: str, rank: int, method: str, error: str, remote_traceback: str,
                 node_id: str | None = None, node_lost: bool = False):
        super().__init__(role, rank, method, error, remote_traceback)
        self.node_id, self.node_lost = node_id, node_lost

    def __reduce__(self):
        return (type(self), (self.role, self.rank, self.method, self.error, self.remote_traceback, self.node_id,
                             self.node_lost))


class WorkerTimeoutError(WorkerError):
    """A call ran past the group's time limit (a hung worker or a stuck collective)."""


LOOPBACK = "127.0.0.1"
# A collective that failed with one of these lost its connection to a peer rank: that rank's
# process (or node) is probably gone, which Ray confirms when it notices (a lost node: when its
# health checks go unanswered, ~15-30 s with Ray's defaults, `RAY_health_check_*`).
PEER_LOST_SIGNS = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "Connection refused")
PEER_DEATH_WAIT_S = 60.0


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
            on_loopback = _node_registered_on_loopback(address)
            if on_loopback is not False:
                try:
                    with _ray_node_ip_kept_local():
                        ray.init(address=address, log_to_driver=True, _node_ip_address=LOOPBACK)
                    return True
                except (ConnectionError, RuntimeError):
                    ray.shutdown()
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


def bundle_of(cpus: float, gpus: float = 0.0, resources: dict[str, float] | None = None) -> dict[str, float]:
    """One bundle of a pool as Ray reserves it: CPUs, GPUs when any, and the pool's custom resources."""
    bundle = {"CPU": float(cpus), **{k: float(v) for k, v in (resources or {}).items()}}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


POOL_TIMEOUT_S = 120.0  # how long a pool waits for its bundles (nodes joining: an autoscaler, a replacement)


class ResourcePool:
    """A placement group of `bundles` equal bundles; rank r of each group on it uses bundle r."""

    def __init__(self, name: str, bundles: int, cpus_per_bundle: float = 1.0, gpus_per_bundle: float = 0.0,
                 strategy: str = "PACK", timeout_s: float = POOL_TIMEOUT_S, resources: dict[str, float] | None = None,
                 label_selector: dict[str, str] | None = None):
        """`resources`: custom resources every bundle also reserves (only nodes that have them hold
        the pool); `label_selector`: node labels every bundle's node must match (Ray's syntax)."""
        import ray
        from ray.util.placement_group import placement_group

        if bundles < 1:
            raise ValueError(f"resource pool {name!r}: bundles must be >= 1, got {bundles}")
        self.name, self.bundles = name, bundles
        self.cpus_per_bundle, self.gpus_per_bundle = float(cpus_per_bundle), float(gpus_per_bundle)
        bundle = bundle_of(self.cpus_per_bundle, self.gpus_per_bundle, resources)
        selectors = [dict(label_selector) for _ in range(bundles)] if label_selector else None
        self.pg = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy,
                                  bundle_label_selector=selectors)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            where = f" on nodes labelled {label_selector}" if label_selector else ""
            raise RuntimeError(
                f"resource pool {name!r} (ray.pools.{name}): could not reserve {bundles} x {bundle}{where} "
                f"({strategy}) within {timeout_s:.0f}s; the cluster's live nodes: {describe_nodes()}"
            ) from None

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # already gone with the cluster
            pass

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, bundles={self.bundles}, cpu={self.cpus_per_bundle}, gpu={self.gpus_per_bundle})"


class PlacementError(RLCoreError):
    """The pools of a run can never be placed on the cluster (nothing was started on it)."""


@dataclass(frozen=True)
class PoolDemand:
    """What one resource pool asks of the cluster: `bundles` alike bundles (`bundle_of`), placed by
    `strategy` on nodes matching `label_selector`; `why` names the config key that set the count."""

    name: str
    bundles: int
    bundle: dict[str, float]
    strategy: str = "PACK"
    label_selector: dict[str, str] = field(default_factory=dict)
    why: str = ""


_MANY = 1 << 62  # bundles a node holds when a bundle reserves nothing


def _per_node(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles a node with `resources` holds (Ray counts in units of 1e-4)."""
    counts = [math.floor(resources.get(k, 0.0) / v + 1e-6) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else _MANY


def _label_matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Ray's label selector semantics: 'v', '!v', 'in(a,b)', '!in(a,b)' per key (an empty
    condition matches every node: it is not refused on a guess)."""
    for key, condition in selector.items():
        negated, body = condition.startswith("!"), condition.lstrip("!")
        if not body:
            continue
        wanted = {v.strip() for v in body[3:-1].split(",")} if body.startswith("in(") and body.endswith(")") else {body}
        if (labels.get(key) in wanted) == negated:
            return False
    return True


def placement_shortfall(demands: list[PoolDemand], nodes: list[dict[str, Any]]) -> str | None:
    """Why `demands` cannot all be placed on `nodes` (`ray.nodes()` entries: `Resources`, `Labels`),
    or None when they can: each pool on the nodes its labels allow, by its strategy, and all pools
    together within the nodes' totals. Necessary conditions, not a full bin packing: a set of
    pools that passes may still wait (fragmentation; other jobs' reservations)."""
    for pool in demands:
        eligible = [n for n in nodes if _label_matches(n.get("Labels") or {}, pool.label_selector)]
        per_node = [_per_node(n.get("Resources") or {}, pool.bundle) for n in eligible]
        if pool.strategy == "STRICT_PACK":
            fits, rule = max(per_node, default=0), "all on one node (STRICT_PACK)"
        elif pool.strategy == "STRICT_SPREAD":
            fits, rule = sum(1 for k in per_node if k >= 1), "each on its own node (STRICT_SPREAD)"
        else:
            fits, rule = sum(per_node), pool.strategy
        if fits < pool.bundles:
            where = f" on nodes labelled {pool.label_selector}" if pool.label_selector else ""
            total = {k: _amount(v * pool.bundles) for k, v in pool.bundle.items() if v > 0}
            room = min(fits, pool.bundles)
            return (f"{pool.why}: pool {pool.name!r} (ray.pools.{pool.name}) needs {pool.bundles} bundles of "
                    f"{_shown_bundle(pool.bundle)}, {rule}{where} ({_shown_bundle(total)} in all), and the cluster has "
                    f"room for {room}")
    need: dict[str, float] = {}
    for pool in demands:
        for k, v in pool.bundle.items():
            need[k] = need.get(k, 0.0) + v * pool.bundles
    have = cluster_totals(nodes)
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-6}
    if short:
        parts = ", ".join(f"{p.name!r} {p.bundles} x {_shown_bundle(p.bundle)} ({p.why})" for p in demands)
        return (f"the pools together need {_shown_bundle({k: _amount(v) for k, v in need.items()})} ({parts}), more "
                f"than the cluster has")
    return None


def cluster_totals(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Every resource of `nodes` summed (`ray.cluster_resources()` for the live nodes)."""
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in (node.get("Resources") or {}).items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _amount(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 4)


def _shown_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in bundle.items()) + "}"


def _shown_cluster(nodes: list[dict[str, Any]], demands: list[PoolDemand]) -> str:
    """What the cluster has of the resources `demands` use, and its nodes."""
    totals = cluster_totals(nodes)
    names = ["CPU", "GPU", *sorted({k for p in demands for k in p.bundle} - {"CPU", "GPU"})]
    labelled = {str(p.label_selector): sum(_label_matches(n.get("Labels") or {}, p.label_selector) for n in nodes)
                for p in demands if p.label_selector}
    nodes_part = f"{len(nodes)} live node{'s' if len(nodes) != 1 else ''}"
    if labelled:
        nodes_part += ", " + ", ".join(f"{n} labelled {sel}" for sel, n in labelled.items())
    return f"{_shown_bundle({k: totals.get(k, 0.0) for k in names})} on {nodes_part}"


def _autoscaler_ceiling() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler may grow it to (what it reported to the
    GCS); None for a cluster without one (a local Ray, `ray start` by hand)."""
    try:
        from ray._private.state import state

        ceiling = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - another Ray layout: judged as a fixed cluster
        return None
    return {k: float(v) for k, v in ceiling.items()} if ceiling else None


def placement_verdict(demands: list[PoolDemand], nodes: list[dict[str, Any]], ceiling: dict[str, float] | None,
                      local: bool, hint: str = "") -> tuple[str, str | None]:
    """("fits", None), ("wait", why) or ("refuse", why) for `demands` on a cluster of `nodes`
    (`ray.nodes()`: live and dead) whose autoscaler grows it to `ceiling` (None: none does).

    Judged against the live nodes. A cluster that can grow is given the chance: one whose
    autoscaler reports a ceiling is refused only beyond that ceiling, and one that lost nodes
    only beyond what it had with them: the pools then wait up to `POOL_TIMEOUT_S` for nodes to
    join. A local Ray (`local`) never grows."""
    alive = [n for n in nodes if n.get("Alive")]
    shortfall = placement_shortfall(demands, alive)
    if shortfall is None:
        return "fits", None
    has = _shown_cluster(alive, demands)
    if not local and ceiling is not None:
        # the ceiling is a total: pools bound to labels or to node counts are left to the wait
        judged = all(p.strategy in ("PACK", "SPREAD") and not p.label_selector for p in demands)
        if not judged or placement_shortfall(demands, [{"Resources": ceiling}]) is None:
            return "wait", (f"{shortfall} now: {has}; its autoscaler may add nodes (up to {_shown_bundle(ceiling)}): "
                            f"the pools wait up to {POOL_TIMEOUT_S:.0f} s for them")
        return "refuse", f"{shortfall}: {has}, and its autoscaler grows it to at most {_shown_bundle(ceiling)}"
    lost = [n for n in nodes if not n.get("Alive")]
    if not local and lost and placement_shortfall(demands, [*alive, *lost]) is None:
        return "wait", (f"{shortfall} since it lost {len(lost)} node(s): {has}; the pools wait up to "
                        f"{POOL_TIMEOUT_S:.0f} s for replacements")
    return "refuse", f"{shortfall}: {has}{hint}"


def check_placement(demands: list[PoolDemand], local: bool, hint: str = "") -> None:
    """Refuse (PlacementError) pools the connected cluster can never hold, before any is made,
    naming the key, what they need and what the cluster has; say at once when they must wait for
    nodes to join (`placement_verdict`)."""
    import ray

    verdict, why = placement_verdict(demands, ray.nodes(), None if local else _autoscaler_ceiling(), local, hint)
    if verdict == "refuse":
        raise PlacementError(why)
    if verdict == "wait":
        log.warning("%s", why)


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


class _WorkerHost:
    """The Ray actor around one rank's Worker. Every worker call goes through `execute`."""

    def __init__(self, role: str, rank: int, world_size: int, env: dict[str, str], cpus: float = 1.0,
                 threads: int | None = None):
        os.environ.update(env)
        use_cores(threads=threads if threads is not None else sized_threads(cpus))
        self.role, self.rank, self.world_size = role, rank, world_size
        self.worker: Worker | None = None
        self.store_listener: socket.socket | None = None  # rank 0: the TCP store's socket

    def build(self, factory: Callable[[int, int], Worker]) -> dict[str, MethodSpec]:
        try:
            w = factory(self.rank, self.world_size)
            if not isinstance(w, Worker):
                raise TypeError(f"worker_factory returned {type(w).__name__}, not a Worker")
            if (w.rank, w.world_size) != (self.rank, self.world_size):
                raise ValueError(f"worker_factory built rank {w.rank}/{w.world_size} "
                                 f"when asked for rank {self.rank}/{self.world_size}")
        except Exception as e:
            raise WorkerError.from_exception(self.role, self.rank, "__init__", e) from None
        w.role = w.role or self.role
        self.worker = w
        return w.registered_methods()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and the port rank 0's TCP store will serve on. The socket is bound
        to that address only (torch's own store would listen on every interface) and held open
        until `init_distributed` hands it to the store, so no other process can take the port."""
        import ray

        addr = ray.util.get_node_ip_address()
        listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((addr, 0))
        listener.listen(128)
        self.store_listener = listener
        return addr, listener.getsockname()[1]

    def init_distributed(self, addr: str, port: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        timeout = timedelta(seconds=timeout_s)
        try:
            if backend == "nccl":
                import torch

                torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            if backend == "gloo" and is_loopback(addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
                # every rank is on this machine (a loopback cluster): gloo's pairs listen on
                # loopback too, not on whatever address the host name resolves to
                name = interface_with(addr)
                if name is not None:
                    os.environ["GLOO_SOCKET_IFNAME"] = name
            if self.rank == 0:
                assert self.store_listener is not None, "rendezvous_address runs on rank 0 first"
                store = dist.TCPStore(addr, port, self.world_size, is_master=True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=self.store_listener.fileno())
            else:
                store = dist.TCPStore(addr, port, self.world_size, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        except Exception as e:
            raise WorkerError.from_exception(self.role, self.rank, "init_distributed", e) from None

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.worker.execute(method, *args, **kwargs)
        except Exception as e:
            raise WorkerError.from_exception(self.role, self.rank, method, e) from None

    def identity(self) -> dict[str, Any]:
        """Where this rank runs: process id, host name, Ray node id and address (for traces and
        for naming the node when the rank is lost)."""
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    def __repr__(self) -> str:  # Ray prefixes the worker's log lines with it: "(actor:1 pid=...)"
        return f"{self.role}:{self.rank}"


class RayGroupFuture(GroupFuture):
    """A `GroupFuture` that also knows the ObjectRef of a single-rank result, so it can be handed
    to another group's call without passing through the controller."""

    def __init__(self, wait: Callable[[], Any], ref: Any | None):
        super().__init__(wait)
        self.ref = ref


class RayWorkerGroup(WorkerGroup):
    """`world_size` Ray actors, one per rank, each running `worker_factory(rank, world_size)`.

    `pool`: where rank r goes (bundle r); None means no placement group (Ray places the actors).
    `share`: fraction of a bundle's CPUs/GPUs each rank takes (groups sharing a pool split it).
    `distributed`: create a torch.distributed process group across the ranks before `setup()`
    (default: when world_size > 1). After a failure in a distributed group, further calls raise
    at once: the other ranks may be stuck in a collective, so the group must be rebuilt (resume).
    """

    def __init__(self, worker_factory: Callable[[int, int], Worker], world_size: int = 1,
                 role: str = "worker", *, pool: ResourcePool | None = None, share: float = 1.0,
                 distributed: bool | None = None, dist_backend: str | None = None,
                 env_vars: dict[str, str] | None = None, call_timeout_s: float | None = 3600.0,
                 init_timeout_s: float = 600.0, wait: bool = True):
        super().__init__(role, world_size)
        import ray

        if pool is not None and pool.bundles < world_size:
            raise ValueError(f"{role}: world_size {world_size} does not fit pool {pool.name!r} "
                             f"of {pool.bundles} bundles")
        self.call_timeout_s = call_timeout_s
        self.init_timeout_s = init_timeout_s
        self._pool = pool
        self._failed: WorkerError | None = None
        self._distributed = False
        self._actors: list[Any] = []
        self._where: list[dict[str, Any]] = []  # identity() of each rank, once started
        gpus = pool.gpus_per_bundle * share if pool is not None else 0.0
        cpus = _floor4(pool.cpus_per_bundle * share) if pool is not None else 1.0
        threads, thread_env = worker_threads(cpus)
        env = {**WORKER_ENV, **thread_env, **(env_vars or {})}
        host_cls = ray.remote(_WorkerHost)
        try:
            for rank in range(world_size):
                options: dict[str, Any] = dict(num_cpus=cpus, num_gpus=_floor4(gpus), max_restarts=0,
                                               runtime_env={"env_vars": env})
                if pool is not None:
                    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group=pool.pg, placement_group_bundle_index=rank)
                self._actors.append(host_cls.options(**options).remote(role, rank, world_size, env, cpus, threads))
            self._build_refs = [(r, a.build.remote(worker_factory)) for r, a in enumerate(self._actors)]
        except BaseException:
            self._kill_actors()
            raise
        self._want_distributed = distributed if distributed is not None else world_size > 1
        self._dist_backend = dist_backend or ("nccl" if gpus > 0 else "gloo")
        self._started = False
        if wait:
            self.wait_started()

    def wait_started(self) -> RayWorkerGroup:
        """Wait for the workers to be built, rendezvous and `setup()`. With `wait=False` the
        constructor only submits the actors (from the calling thread: Ray actor handles are best
        created there), so several groups can start at once and be waited for from threads."""
        if self._started:
            return self
        try:
            specs = self._wait_all("__init__", self._build_refs, self.init_timeout_s)
            self._methods: dict[str, MethodSpec] = specs[0]
            self._where = self.identities()
            self._distributed = self._want_distributed
            if self._distributed:
                addr, port = self._wait_all("init_distributed", [(0, self._actors[0].rendezvous_address.remote())],
                                            self.init_timeout_s)[0]
                timeout = self.call_timeout_s or 1800.0
                self._wait_all("init_distributed", [
                    (r, a.init_distributed.remote(addr, port, self._dist_backend, timeout))
                    for r, a in enumerate(self._actors)
                ], self.init_timeout_s)
            self._wait_all("setup", [(r, a.execute.remote("setup")) for r, a in enumerate(self._actors)],
                           self.init_timeout_s)
        except BaseException:
            self._kill_actors()
            raise
        self._started = True
        self._build_refs = []
        return self

    # ----- the WorkerGroup interface ------------------------------------------------------------

    @property
    def methods(self) -> dict[str, MethodSpec]:
        if not self._started:
            raise RuntimeError(f"worker group {self.role!r}: call wait_started() first")
        return self._methods

    def pids(self) -> list[int]:
        """Process id of each rank (for tests and debugging)."""
        return [ident["pid"] for ident in self.identities()]

    def identities(self) -> list[dict[str, Any]]:
        """{pid, host, node_id, node_ip} of each rank, in rank order."""
        self._check_usable()
        return self._wait_all("identity", [(r, a.identity.remote()) for r, a in enumerate(self._actors)], 60.0)

    def _check_usable(self) -> None:
        """After a rank failed, the group's other ranks may be stuck in a collective: refuse calls."""
        if self._failed is not None:
            raise RuntimeError(
                f"worker group {self.role!r} is unusable after rank {self._failed.rank} failed in "
                f"{self._failed.method!r} (its ranks may be stuck in a collective); rebuild the "
                f"groups (resume from the last checkpoint). First failure: {self._failed.error}"
            )

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> RayGroupFuture:
        self._check_usable()
        future = super().call_async(method, *args, **kwargs)  # the future comes from _make_future
        upstream = [v for v in (*args, *kwargs.values()) if isinstance(v, RayGroupFuture) and v.ref is not None]
        if not upstream:
            return future
        return RayGroupFuture(lambda: _blaming_upstream(future, upstream), future.ref)

    def _prepare_args(self, dispatch: Dispatch, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Futures as arguments: a single-rank result goes on as its ObjectRef (Ray resolves it in
        the receiving worker); anything that must be split here is fetched first."""
        passthrough = dispatch in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO, Dispatch.COLLECTIVE)

        def resolve(v: Any) -> Any:
            if isinstance(v, RayGroupFuture) and v.ref is not None and passthrough:
                return v.ref
            return v.result() if isinstance(v, GroupFuture) else v

        return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}

    def _launch(self, method: str, calls: list[tuple[int, tuple, dict]]) -> Callable[[], list[Any]]:
        import ray

        shared: dict[int, Any] = {}  # an argument sent to several ranks goes to the object store once
        if len(calls) > 1:
            seen: dict[int, int] = {}
            for _, args, kwargs in calls:
                for v in (*args, *kwargs.values()):
                    seen[id(v)] = seen.get(id(v), 0) + 1
            for _, args, kwargs in calls:
                for v in (*args, *kwargs.values()):
                    if seen[id(v)] > 1 and id(v) not in shared and _worth_putting(v):
                        shared[id(v)] = ray.put(v)

        def put(v: Any) -> Any:
            return shared.get(id(v), v)

        refs = [(rank, self._actors[rank].execute.remote(method, *map(put, args),
                                                         **{k: put(v) for k, v in kwargs.items()}))
                for rank, args, kwargs in calls]
        self._last_refs = refs
        return lambda: self._wait_all(method, refs, self.call_timeout_s)

    def _make_future(self, dispatch: Dispatch, wait: Callable[[], Any]) -> RayGroupFuture:
        single = dispatch in (Dispatch.RANK_ZERO, Dispatch.COLLECTIVE)
        return RayGroupFuture(wait, self._last_refs[0][1] if single else None)

    def _shutdown_workers(self) -> None:
        if self._failed is None and self._actors and self._started:
            try:
                self._wait_all("shutdown", [(r, a.execute.remote("shutdown")) for r, a in enumerate(self._actors)],
                               min(60.0, self.call_timeout_s or 60.0))
            except (WorkerError, RuntimeError) as e:
                log.warning("%s: shutdown failed: %s", self.role, e)
        self._kill_actors()

    def _kill_actors(self) -> None:
        import ray

        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        self._actors = []
        self._build_refs, self._last_refs = [], []

    # ----- waiting, with failures mapped to WorkerError ------------------------------------------

    def _wait_all(self, method: str, refs: list[tuple[int, Any]], timeout_s: float | None) -> list[Any]:
        """Results in `refs` order. The first failing rank raises at once, without waiting for
        the others (they may be blocked in a collective with the dead one)."""
        import ray

        index = {ref: i for i, (_, ref) in enumerate(refs)}
        rank_of = {ref: rank for rank, ref in refs}
        results: list[Any] = [None] * len(refs)
        pending = [ref for _, ref in refs]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = 5.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            for ref in ready:
                try:
                    results[index[ref]] = self._get(ref, rank_of[ref], method)
                except WorkerError as err:
                    raise self._root_cause(err, pending, rank_of, method) from None
            if not ready and deadline is not None and time.monotonic() >= deadline:
                ranks = sorted(rank_of[r] for r in pending)
                err = WorkerTimeoutError(self.role, ranks[0], method,
                                         f"no result from ranks {ranks} after {timeout_s:.0f}s", "(still running)")
                self._fail(err)
                raise err
        return results

    def _root_cause(self, err: WorkerError, pending: list[Any], rank_of: dict, method: str) -> WorkerError:
        """When one rank of a distributed group fails, its peers' collectives fail too: a rank
        whose collective broke because another rank died must not hide that death. Give the
        other ranks a few seconds and report a death among them first. When the failure is a
        broken connection to a peer (its process, or its whole node, is gone), wait as long as Ray
        may take to notice a lost node (`PEER_DEATH_WAIT_S`), and ask every other rank whether it
        is alive: the dead one may have finished its part of this call before it died."""
        import ray

        if not self._distributed or isinstance(err, WorkerDiedError):
            return err
        peer_lost = any(sign in err.error for sign in PEER_LOST_SIGNS)
        deadline = time.monotonic() + (PEER_DEATH_WAIT_S if peer_lost else 5.0)
        probes = [(rank_of[ref], ref) for ref in pending]
        if peer_lost:
            probes += [(r, a.identity.remote()) for r, a in enumerate(self._actors) if r != err.rank]
        waiting = {ref: rank for rank, ref in probes}
        while waiting and time.monotonic() < deadline:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                rank = waiting.pop(ref)
                try:
                    ray.get(ref, timeout=60.0)
                except ray.exceptions.RayTaskError:  # this rank failed too (its collective broke): not the cause
                    pass
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                        ray.exceptions.NodeDiedError) as e:
                    died = self._died(rank, method, e)
                    self._failed = died
                    return died
                except ray.exceptions.RayError:
                    pass
        return err

    def _get(self, ref: Any, rank: int, method: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=60.0)  # ready already: only the transfer remains
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, WorkerError):
                err = type(cause)(cause.role, cause.rank, cause.method, cause.error, cause.remote_traceback)
            else:
                err = WorkerError(self.role, rank, method, f"{type(cause).__name__}: {cause}", str(e))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError,
                ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as e:
            err = self._died(rank, method, e)
        except ray.exceptions.GetTimeoutError as e:
            err = WorkerTimeoutError(self.role, rank, method, "fetching the result timed out", str(e))
        self._fail(err)
        raise err

    def _died(self, rank: int, method: str, e: BaseException) -> WorkerDiedError:
        """The error for a rank whose process is gone, naming its node and whether the node was lost
        (a dead node's workers all die with it; Ray notices when its health checks go unanswered).
        A rank that is only unreachable is asked again until Ray says it died or it answers."""
        import ray

        if isinstance(e, ray.exceptions.ActorUnavailableError):
            e = self._settle(rank, e)
        node_id = self._where[rank]["node_id"] if rank < len(self._where) else None
        if node_id is None:
            return WorkerDiedError(self.role, rank, method, f"the worker process died ({type(e).__name__})", str(e))
        try:
            alive, name = node_state(node_id)
        except Exception:  # noqa: BLE001 - the GCS itself is unreachable: say what is known
            alive, name = True, f"node {node_id[:12]}"
        if not alive:
            what = f"its {name} was lost"
        elif isinstance(e, ray.exceptions.ActorUnavailableError):
            what = f"the worker became unreachable on {name}"
        else:
            what = f"the worker process died on {name}"
        return WorkerDiedError(self.role, rank, method, f"{what} ({type(e).__name__})", str(e),
                               node_id=node_id, node_lost=not alive)

    def _settle(self, rank: int, unavailable: BaseException) -> BaseException:
        """Ask an unreachable rank (Ray: "temporarily unavailable", e.g. its node stopped answering)
        until Ray says it died (returns that error) or it answers (returns `unavailable`), for at
        most PEER_DEATH_WAIT_S: Ray declares a lost node dead only after its health checks fail."""
        import ray

        deadline = time.monotonic() + PEER_DEATH_WAIT_S
        while rank < len(self._actors) and time.monotonic() < deadline:
            try:
                ray.get(self._actors[rank].identity.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return unavailable
            except ray.exceptions.ActorUnavailableError:
                time.sleep(1.0)
            except ray.exceptions.RayActorError as e:
                return e
            except ray.exceptions.GetTimeoutError:  # reachable, busy: alive
                return unavailable
        return unavailable

    def _fail(self, err: WorkerError) -> None:
        if self._distributed or isinstance(err, (WorkerDiedError, WorkerTimeoutError)):
            self._failed = self._failed or err


def _blaming_upstream(future: RayGroupFuture, upstream: list[RayGroupFuture]) -> Any:
    """The result of a call that took other groups' futures as ObjectRefs. When it fails because
    one of those failed (the error names another role), the producing group's own wait reports
    the root cause: a rank of it that died, not its peer whose collective broke, and that group
    is marked failed. Only on failure: a passed future is otherwise never fetched here."""
    try:
        return future.result()
    except WorkerError:
        for up in upstream:
            try:
                up.result()
            except WorkerError as cause:
                raise cause from None
        raise


def _floor4(x: float) -> float:
    """Ray resolves resources to 1e-4; round down so shares of a bundle never exceed it."""
    return int(x * 10_000) / 10_000


def _worth_putting(v: Any) -> bool:
    """Objects worth one shared copy in the object store (not refs, not small scalars)."""
    import ray

    if isinstance(v, ray.ObjectRef):
        return False
    return not isinstance(v, (int, float, str, bool, bytes, type(None))) or (isinstance(v, bytes) and len(v) > 4096)
