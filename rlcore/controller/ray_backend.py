"""`RayWorkerGroup`: the worker-group interface with each rank in its own Ray actor.

Planning and collecting are shared with the in-process backend (`plan_dispatch`); this module
only starts per-rank calls (`execute.remote`) and waits for them. What it adds:

- placement: rank r of every group on a `ResourcePool` (`ray_placement.py`) runs on bundle r,
  taking `share` of that bundle (several groups, or one group of colocated roles via
  `ColocatedWorker`, can live on one pool); each rank reports the node it runs on (`identities()`);
- futures that travel: a rank-zero/collective result passed to another group's call goes over
  as an ObjectRef, worker to worker, without being fetched into the controller;
- failures: a worker that raises becomes `WorkerError` (role, rank, method, remote traceback);
  a worker process that dies becomes `WorkerDiedError` as soon as Ray notices, naming the node it
  ran on and whether that node was lost, and a call that runs past `call_timeout_s` becomes
  `WorkerTimeoutError`: never an unbounded wait;
- torch.distributed: with `distributed=True` the ranks rendezvous (rank 0's node address and a
  free port it picks) before `setup()`, gloo on CPU, nccl with GPUs.

Starting or joining the cluster, its addresses and interfaces: `ray_cluster.py`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rlcore.controller.dispatch import Dispatch, MethodSpec
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import GroupFuture, WorkerGroup
from rlcore.controller.ray_cluster import interface_with, is_loopback, node_state
from rlcore.controller.ray_placement import ResourcePool
from rlcore.controller.worker import Worker
from rlcore.cpus import explicit_threads, sized_threads, use_cores

__all__ = [
    "RayGroupFuture",
    "RayWorkerGroup",
    "WorkerDiedError",
    "WorkerTimeoutError",
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


# A collective that failed with one of these lost its connection to a peer rank: that rank's
# process (or node) is probably gone, which Ray confirms when it notices (a lost node: when its
# health checks go unanswered, ~15-30 s with Ray's defaults, `RAY_health_check_*`).
PEER_LOST_SIGNS = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "Connection refused")
PEER_DEATH_WAIT_S = 60.0


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
