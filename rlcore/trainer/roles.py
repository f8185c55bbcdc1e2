"""Which worker groups a run has, and how they are built: in this process, or as Ray actors
placed on resource pools (`trainer.backend`). The control flow sees the same `WorkerGroups`
(`rlcore.trainer.groups`: one typed interface per role).

With LoRA on the actor there is no reference worker: `ref` is the actor group itself, whose
`compute_ref_log_prob` runs the base with the adapter disabled."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from rlcore.config import Config, LoraSync, RayConfig, RoleSpec, role_spec
from rlcore.controller import (
    ColocatedWorker,
    InProcessWorkerGroup,
    RoleView,
    SubprocessWorkerGroup,
    Worker,
    WorkerGroup,
)
from rlcore.cpus import available_cpus, split_cores, use_cores
from rlcore.trainer.groups import WorkerGroups
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward import RewardWorker
from rlcore.workers.reward_model import RewardModelWorker
from rlcore.workers.rollout import RolloutWorker

if TYPE_CHECKING:
    from rlcore.controller.ray_placement import PoolDemand

Factory = Callable[[int, int], Worker]  # (rank, world size) -> the worker of that rank


@dataclass(frozen=True)
class RoleGroup:
    """One role's group as placement sees it: its worker class, the `RoleSpec` each rank is
    handed, its ranks and the key that set them (named when a pool cannot hold them)."""

    worker: Callable[..., Worker]
    spec: RoleSpec[Any]
    world_size: int
    size_key: str

    def factory(self, rank: int, ws: int) -> Worker:
        return self.worker(self.spec, rank, ws)


@dataclass(frozen=True)
class Placement:
    """What building a run's worker groups reads: its roles' groups, the backend and Ray's pools,
    how the actor's weights reach the engine, whether generation overlaps the step (in a thread
    or a child process: `trainer.off_policy=one_step`, `trainer.overlap_with`) and whether the
    actor group also serves the reference (LoRA). `placement` makes one from an RL `Config`;
    `rlcore sft` makes its own from the actor's spec."""

    roles: Mapping[str, RoleGroup]
    backend: str
    ray: RayConfig
    weight_sync: LoraSync = "full"
    overlap: Literal["none", "thread", "process"] = "none"
    actor_is_reference: bool = False


def section_size_key(role: str, section: Any) -> str:
    """The key that set a role section's ranks, with its value (for messages)."""
    if section.layout is not None:
        return f"{role}.layout ({section.layout.describe()})"
    return f"{role}.world_size={section.world_size}"


def _size_key(config: Config, role: str) -> str:
    """The config key that sets how many ranks `role` has, with its value (for messages)."""
    if role == "reward":
        return "reward (1 rank)"
    if role == "ref" and config.ref.layout is None:  # ref follows the actor
        return section_size_key("actor", config.actor)
    if role == "ref":
        return f"ref.layout ({config.layout_of(role).describe()})"
    return section_size_key(role, getattr(config, role))


def placement(config: Config) -> Placement:
    """The RL run `config`'s `Placement`: the roles this run has (`Config.present_roles`), each
    handed its `role_spec`, never the whole config; with LoRA on the actor no reference worker:
    the actor serves that role."""
    workers: dict[str, tuple[Callable[..., Worker], int]] = {
        "actor": (ActorWorker, config.actor.world_size),
        "rollout": (RolloutWorker, config.rollout.world_size),
        "reward": (RewardWorker, 1),
        "ref": (ReferenceWorker, config.layout_of("ref").world_size),
        "critic": (CriticWorker, config.critic.world_size),
        "reward_model": (RewardModelWorker, config.reward_model.world_size),
    }
    present = [role for role in config.present_roles if not (role == "ref" and config.actor.lora.enabled)]
    groups: dict[str, RoleGroup] = {
        role: RoleGroup(workers[role][0], role_spec(config, role), workers[role][1], _size_key(config, role)) for role in present}
    t = config.trainer
    # one_step or async: the rollout generates beside the update
    overlap: Literal["none", "thread", "process"] = t.overlap_with if t.off_policy != "sync" else "none"
    return Placement(groups, t.backend, config.ray, config.lora_sync, overlap,
                     actor_is_reference=config.needs_reference and config.actor.lora.enabled)


def build_worker_groups(plan: Placement) -> WorkerGroups:
    """The run's worker groups as `plan` places them (an RL run's `placement(config)`; `rlcore
    sft`'s actor alone), and this (controller) thread's torch threads.

    In process, `trainer.off_policy=one_step` gives the rollout worker a thread of its own, or a
    child process (`trainer.overlap_with`), so the next batch's generation overlaps this step's scoring
    and update; the cores are split between it and this thread, this one taking an odd core
    (`rlcore.cpus.split_cores`). Otherwise this thread has all the cores, or one on Ray, where
    the workers compute in their own processes."""
    if plan.backend == "ray":
        use_cores(1)
        return build_ray_worker_groups(plan)
    overlap = plan.overlap != "none"
    train_cores, rollout_cores = split_cores(2) if overlap else (available_cpus(), 0.0)
    use_cores(train_cores)
    groups: dict[str, WorkerGroup | RoleView] = {}
    rollout_elsewhere = plan.overlap == "process"
    for role, group in plan.roles.items():
        if role == "rollout" and rollout_elsewhere:
            groups[role] = SubprocessWorkerGroup(partial(group.worker, group.spec), role=role, cores=rollout_cores)
        else:
            groups[role] = InProcessWorkerGroup(group.factory, world_size=1, role=role, own_thread=overlap and role == "rollout",
                                                cores=rollout_cores)
    return _with_reference(WorkerGroups.of(groups, weight_sync=plan.weight_sync, same_process_sync=not rollout_elsewhere),
                           plan)


def _with_reference(groups: WorkerGroups, plan: Placement) -> WorkerGroups:
    """With LoRA the actor's group is also the reference group (its base, adapter disabled)."""
    if plan.actor_is_reference:
        groups.ref = groups.actor
    return groups


# ----- Ray --------------------------------------------------------------------------------------

DISTRIBUTED_ROLES = {"actor", "ref", "critic", "reward_model"}  # roles that shard their model over ranks (FSDP2)


def _units(ray: RayConfig, roles: Mapping[str, RoleGroup]) -> list[list[str]]:
    """Process groups to start: each colocated set (roles present in this run) and each other role."""
    units: list[list[str]] = []
    placed: set[str] = set()
    for group in ray.colocate:
        present = [r for r in group if r in roles]
        if present:
            sizes = {roles[r].world_size for r in present}
            if len(sizes) > 1:
                raise ValueError(f"ray.colocate: {present} have different world sizes "
                                 f"{[roles[r].world_size for r in present]}; colocated roles share ranks")
            units.append(present)
            placed.update(present)
    units += [[r] for r in roles if r not in placed]
    return units


def pool_demands(ray: RayConfig, roles: Mapping[str, RoleGroup],
                 pool_units: dict[str, list[list[str]]]) -> list[PoolDemand]:
    """What each pool asks of the cluster: a bundle per rank of its largest group (the key that
    set that size named), as `ResourcePool` will reserve them."""
    from rlcore.controller.ray_placement import PoolDemand, bundle_of

    demands = []
    for name, units in pool_units.items():
        largest = max((role for unit in units for role in unit), key=lambda role: roles[role].world_size)
        p = ray.pools[name]
        demands.append(PoolDemand(name, roles[largest].world_size, bundle_of(p.cpus_per_bundle, p.gpus_per_bundle, p.resources),
                                  p.strategy, dict(p.label_selector), why=roles[largest].size_key))
    return demands


LOCAL_RAY_HINT = (" (the local Ray rlcore started: this machine's CPUs and GPUs; ray.num_cpus gives it more CPUs, "
                  "ranks then sharing cores; ray.address runs on a cluster)")


def build_ray_worker_groups(plan: Placement) -> WorkerGroups:
    """Ray actors for every role of `plan`, on placement-group pools mapped by `ray.roles`.
    Pools the cluster can never hold are refused first (`check_placement`), before any is made."""
    from rlcore.controller.ray_backend import RayWorkerGroup
    from rlcore.controller.ray_cluster import effective_address, ensure_ray
    from rlcore.controller.ray_placement import ResourcePool, check_placement

    rc, roles = plan.ray, plan.roles
    units = _units(rc, roles)
    pool_units: dict[str, list[list[str]]] = {}
    for unit in units:
        pool_units.setdefault(rc.pool_of(unit[0]), []).append(unit)
    bundles = {name: max(roles[u[0]].world_size for u in us) for name, us in pool_units.items()}

    on_close: list[Callable[[], None]] = []
    started = ensure_ray(rc.address, rc.num_cpus, rc.temp_dir)
    local = started and effective_address(rc.address) is None  # a Ray this run started here: it never grows
    if started:
        import ray

        on_close.append(ray.shutdown)
    made: dict[tuple[str, ...], RayWorkerGroup] = {}
    try:
        check_placement(pool_demands(rc, roles, pool_units), local=local, hint=LOCAL_RAY_HINT if local else "")
        pools = {}
        for name, n in bundles.items():
            p = rc.pools[name]
            pools[name] = ResourcePool(name, n, p.cpus_per_bundle, p.gpus_per_bundle, p.strategy,
                                       resources=p.resources, label_selector=p.label_selector)
            on_close.append(pools[name].remove)

        def submit(unit: list[str]) -> RayWorkerGroup:
            pool_name = rc.pool_of(unit[0])
            ws = roles[unit[0]].world_size
            if len(unit) == 1:
                factory: Factory = roles[unit[0]].factory
            else:
                parts: dict[str, Factory] = {r: roles[r].factory for r in unit}
                factory = _colocated_factory(parts)
            return RayWorkerGroup(
                factory, ws, "+".join(unit), pool=pools[pool_name], share=1.0 / len(pool_units[pool_name]),
                distributed=ws > 1 and bool(DISTRIBUTED_ROLES & set(unit)),
                call_timeout_s=rc.call_timeout_s, init_timeout_s=rc.init_timeout_s, wait=False,
            )

        for unit in units:  # actors are created here; their start-ups (model loads) overlap
            made[tuple(unit)] = submit(unit)
        with ThreadPoolExecutor(max_workers=len(units)) as ex:
            futures = [ex.submit(group.wait_started) for group in made.values()]
            errors = []
            for fut in futures:
                try:
                    fut.result()
                except Exception as e:
                    errors.append(e)
            if errors:
                raise errors[0]
        views: dict[str, WorkerGroup | RoleView] = {}
        for roles_of_group, group in made.items():
            for role in roles_of_group:
                views[role] = group if len(roles_of_group) == 1 else group.view(role)
        return _with_reference(WorkerGroups.of(views, on_close=on_close, weight_sync=plan.weight_sync), plan)
    except BaseException:
        for group in made.values():
            group.shutdown()
        for fn in reversed(on_close):
            fn()
        raise


def _colocated_factory(parts: dict[str, Factory]) -> Factory:
    def factory(rank: int, ws: int) -> Worker:
        return ColocatedWorker({r: f(rank, ws) for r, f in parts.items()}, rank, ws)

    return factory
