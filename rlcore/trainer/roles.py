"""Which worker groups a run has, and how they are built: in this process, or as Ray actors
placed on resource pools (`trainer.backend`). The control flow sees the same `WorkerGroups`
(`rlcore.trainer.groups`: one typed interface per role).

With LoRA on the actor there is no reference worker: `ref` is the actor group itself, whose
`compute_ref_log_prob` runs the base with the adapter disabled."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from rlcore.config import Config, RoleSpec, role_spec
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


def _factories(config: Config, specs: Mapping[str, RoleSpec[Any]] | None = None) -> dict[str, tuple[Factory, int]]:
    """role -> (worker factory, world size) for the roles this run has (`Config.present_roles`);
    with LoRA on the actor no reference worker: the actor serves that role. Each worker is handed
    its role's `RoleSpec` (built once here, or given in `specs`), never the whole config."""
    given = specs or {}
    makers: dict[str, tuple[Callable[..., Worker], int]] = {
        "actor": (ActorWorker, config.actor.world_size),
        "rollout": (RolloutWorker, config.rollout.world_size),
        "reward": (RewardWorker, 1),
        "ref": (ReferenceWorker, config.layout_of("ref").world_size),
        "critic": (CriticWorker, config.critic.world_size),
        "reward_model": (RewardModelWorker, config.reward_model.world_size),
    }
    return {role: (_factory(makers[role][0], given.get(role) or role_spec(config, role)), makers[role][1])
            for role in config.present_roles
            if not (role == "ref" and config.actor.lora.enabled)}


def _factory(worker: Callable[..., Worker], spec: RoleSpec[Any]) -> Factory:
    def factory(rank: int, ws: int) -> Worker:
        return worker(spec, rank, ws)

    return factory


def _factories_of(config: Config, only: Collection[str] | None,
                  specs: Mapping[str, RoleSpec[Any]] | None = None) -> dict[str, tuple[Factory, int]]:
    """`_factories`, or those of its roles in `only`."""
    every = _factories(config, specs)
    return every if only is None else {role: made for role, made in every.items() if role in only}


def build_worker_groups(config: Config, roles: Collection[str] | None = None,
                        specs: Mapping[str, RoleSpec[Any]] | None = None) -> WorkerGroups:
    """The run's worker groups, and this (controller) thread's torch threads. `roles`: only these
    of the run's roles (`rlcore sft`: the actor alone); `specs`: workers' `RoleSpec`s made
    elsewhere (`rlcore sft`: its actor's, from the SFT config), the others `role_spec`'s.

    In process, `trainer.off_policy=one_step` gives the rollout worker a thread of its own, or a
    child process (`trainer.overlap_with`), so the next batch's generation overlaps this step's scoring
    and update; the cores are split between it and this thread, this one taking an odd core
    (`rlcore.cpus.split_cores`). Otherwise this thread has all the cores, or one on Ray, where
    the workers compute in their own processes."""
    if config.trainer.backend == "ray":
        use_cores(1)
        return build_ray_worker_groups(config, roles, specs)
    overlap = config.trainer.off_policy != "sync"  # one_step or async: the rollout generates beside the update
    train_cores, rollout_cores = split_cores(2) if overlap else (available_cpus(), 0.0)
    use_cores(train_cores)
    groups: dict[str, WorkerGroup | RoleView] = {}
    rollout_elsewhere = overlap and config.trainer.overlap_with == "process"
    for role, (factory, _) in _factories_of(config, roles, specs).items():
        if role == "rollout" and rollout_elsewhere:
            groups[role] = SubprocessWorkerGroup(partial(RolloutWorker, role_spec(config, role)), role=role, cores=rollout_cores)
        else:
            groups[role] = InProcessWorkerGroup(factory, world_size=1, role=role, own_thread=overlap and role == "rollout",
                                                cores=rollout_cores)
    return _with_reference(WorkerGroups.of(groups, weight_sync=config.lora_sync, same_process_sync=not rollout_elsewhere),
                           config)


def _with_reference(groups: WorkerGroups, config: Config) -> WorkerGroups:
    """With LoRA the actor's group is also the reference group (its base, adapter disabled)."""
    if config.needs_reference and config.actor.lora.enabled:
        groups.ref = groups.actor
    return groups


# ----- Ray --------------------------------------------------------------------------------------

DISTRIBUTED_ROLES = {"actor", "ref", "critic", "reward_model"}  # roles that shard their model over ranks (FSDP2)


def _units(config: Config, roles: dict[str, tuple[Factory, int]]) -> list[list[str]]:
    """Process groups to start: each colocated set (roles present in this run) and each other role."""
    units: list[list[str]] = []
    placed: set[str] = set()
    for group in config.ray.colocate:
        present = [r for r in group if r in roles]
        if present:
            sizes = {roles[r][1] for r in present}
            if len(sizes) > 1:
                raise ValueError(f"ray.colocate: {present} have different world sizes "
                                 f"{[roles[r][1] for r in present]}; colocated roles share ranks")
            units.append(present)
            placed.update(present)
    units += [[r] for r in roles if r not in placed]
    return units


def _size_key(config: Config, role: str) -> str:
    """The config key that sets how many ranks `role` has, with its value (for messages)."""
    if role == "reward":
        return "reward (1 rank)"
    owner = "actor" if role == "ref" and config.ref.layout is None else role  # ref follows the actor
    section = getattr(config, owner)
    if section.layout is not None:
        return f"{owner}.layout ({config.layout_of(role).describe()})"
    return f"{owner}.world_size={section.world_size}"


def pool_demands(config: Config, roles: dict[str, tuple[Factory, int]],
                 pool_units: dict[str, list[list[str]]]) -> list[PoolDemand]:
    """What each pool asks of the cluster: a bundle per rank of its largest group (the key that
    set that size named), as `ResourcePool` will reserve them."""
    from rlcore.controller.ray_placement import PoolDemand, bundle_of

    demands = []
    for name, units in pool_units.items():
        largest = max((role for unit in units for role in unit), key=lambda role: roles[role][1])
        p = config.ray.pools[name]
        demands.append(PoolDemand(name, roles[largest][1], bundle_of(p.cpus_per_bundle, p.gpus_per_bundle, p.resources),
                                  p.strategy, dict(p.label_selector), why=_size_key(config, largest)))
    return demands


LOCAL_RAY_HINT = (" (the local Ray rlcore started: this machine's CPUs and GPUs; ray.num_cpus gives it more CPUs, "
                  "ranks then sharing cores; ray.address runs on a cluster)")


def build_ray_worker_groups(config: Config, only: Collection[str] | None = None,
                            specs: Mapping[str, RoleSpec[Any]] | None = None) -> WorkerGroups:
    """Ray actors for every role (or those in `only`), on placement-group pools mapped by `ray.roles`.
    Pools the cluster can never hold are refused first (`check_placement`), before any is made."""
    from rlcore.controller.ray_backend import RayWorkerGroup
    from rlcore.controller.ray_cluster import effective_address, ensure_ray
    from rlcore.controller.ray_placement import ResourcePool, check_placement

    rc = config.ray
    roles = _factories_of(config, only, specs)
    units = _units(config, roles)
    pool_units: dict[str, list[list[str]]] = {}
    for unit in units:
        pool_units.setdefault(rc.pool_of(unit[0]), []).append(unit)
    bundles = {name: max(roles[u[0]][1] for u in us) for name, us in pool_units.items()}

    on_close: list[Callable[[], None]] = []
    started = ensure_ray(rc.address, rc.num_cpus, rc.temp_dir)
    local = started and effective_address(rc.address) is None  # a Ray this run started here: it never grows
    if started:
        import ray

        on_close.append(ray.shutdown)
    made: dict[tuple[str, ...], RayWorkerGroup] = {}
    try:
        check_placement(pool_demands(config, roles, pool_units), local=local, hint=LOCAL_RAY_HINT if local else "")
        pools = {}
        for name, n in bundles.items():
            p = rc.pools[name]
            pools[name] = ResourcePool(name, n, p.cpus_per_bundle, p.gpus_per_bundle, p.strategy,
                                       resources=p.resources, label_selector=p.label_selector)
            on_close.append(pools[name].remove)

        def submit(unit: list[str]) -> RayWorkerGroup:
            pool_name = rc.pool_of(unit[0])
            ws = roles[unit[0]][1]
            if len(unit) == 1:
                factory = roles[unit[0]][0]
            else:
                parts = {r: roles[r][0] for r in unit}
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
        return _with_reference(WorkerGroups.of(views, on_close=on_close, weight_sync=config.lora_sync), config)
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
