"""`rlcore plan`: which layouts of a run fit on the given hardware, per role, and at what peak.

For each role that holds a model (`rlcore.plan.roles`) the planner looks for the smallest layout
(FSDP x Ulysses SP x TP, `rlcore.workers.parallel`'s layouts) that fits: fewest devices first, then
the smallest tensor-parallel size, then the smallest sequence-parallel size. Simulating every
candidate would take long at 70B, so it enumerates smartly:

1. analytic pre-filter: FSDP divides parameters, gradients and AdamW state evenly, so a device
   count whose share of those alone exceeds a device is never simulated (`static_bytes`);
2. one simulation per (sequence-parallel, tensor-parallel) shape on all devices
   (`rlcore.plan.simulate`) splits the peak into what FSDP and TP shard (parameters, gradients,
   AdamW state: they scale as 1 / devices) and the rest (activations, gathered layers: independent
   of the device count at one shape), which predicts the peak at every other device count;
3. the smallest predicted fit is simulated to confirm it (and the next ones, until one fits).

When nothing fits on the hardware, the same split names the smallest hardware that would: more
nodes (when the unsharded rest fits a device), or larger devices (the lowest peak on all devices).
The rollout is planned by arithmetic (`rlcore.plan.rollout`).

Shapes are the sizes the workers accept within a node: Ulysses and TP sizes that divide a node's
devices and suit the model's heads, key/value heads, vocabulary and intermediate size
(`rlcore.workers.parallel.shapes`), TP only for architectures with a tensor-parallel plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlcore.config import Config
from rlcore.plan.hardware import MAX_DEVICES, Hardware, gib
from rlcore.plan.models import ModelFacts, config_dict, read_config
from rlcore.plan.roles import RolePlan, check_micro_batch, role_plans
from rlcore.plan.rollout import RolloutNeeds, RolloutPlan, plan_rollout, rollout_flops
from rlcore.plan.simulate import Layout, Peak, simulate, static_bytes
from rlcore.workers.memory import ActivationCost, size_micro_batch, sleep_decision
from rlcore.workers.parallel.shapes import plan_source, sequence_parallel_problem, tensor_parallel_problems

MAX_CONFIRMATIONS = 4  # simulations spent confirming predicted fits before the planner gives up on a role


@dataclass(frozen=True)
class Tried:
    """One simulated layout of a role."""

    layout: Layout
    peak: Peak
    fits: bool
    flops_per_rank: float


@dataclass
class RoleResult:
    role: RolePlan
    facts: ModelFacts
    step_flops: float                      # the role's model FLOPs per training step, over all its ranks
    tried: list[Tried] = field(default_factory=list)
    smallest: Tried | None = None          # the smallest layout that fits
    nowhere: str | None = None             # why nothing fits, and the smallest hardware that would
    skipped: str | None = None             # why the role was not simulated


@dataclass
class RolloutResult:
    needs: RolloutNeeds
    plans: list[RolloutPlan]
    step_flops: float
    backend: str  # rollout.backend

    @property
    def smallest(self) -> RolloutPlan | None:
        return next((p for p in self.plans if p.fits), None)


@dataclass(frozen=True)
class Colocated:
    """Every role on all devices at once (one Ray pool, as `ray.pools.default` places them): each
    phase's per-device peak is its role's peak plus what the other roles keep on the device
    meanwhile (trained: parameters, gradients and AdamW state; forward-only: parameters; the rollout:
    nothing while asleep, else its weights and KV cache). `rollout.sleep: auto` is decided as the run
    decides it (`rlcore.workers.memory.sleep_decision`), from the planned peaks."""

    phases: tuple[tuple[str, int], ...]  # (what runs, per-device bytes)
    rollout_sleeps: bool
    why: str = ""  # how `rollout.sleep` chose

    @property
    def peak(self) -> tuple[str, int]:
        return max(self.phases, key=lambda phase: phase[1])


@dataclass
class PlanReport:
    hardware: Hardware
    config: Config
    roles: list[RoleResult]
    rollout: RolloutResult | None
    exact: bool
    colocated: Colocated | None = None


def plan_run(config: Config, hardware: Hardware, *, exact: bool = False, tensor_parallel: list[int] | None = None,
             progress: Callable[[str], None] = lambda line: None) -> PlanReport:
    """Plan every role of `config` on `hardware` (see the module docstring). `exact`: simulate every
    layer instead of extrapolating from two shallow copies. `tensor_parallel`: the trained roles'
    tensor-parallel sizes to consider (default: every size the model takes within a node).

    Everything the run names is checked before the first simulation: the tensor-parallel sizes,
    each role's micro-batch, every model's config.json and architecture (PlanInputError naming the
    argument, key or file), so a bad input never waits behind minutes of simulation."""
    hardware.check_tensor_parallel(tensor_parallel)
    plans = role_plans(config)
    for role in plans:
        check_micro_batch(role)
    configs: dict[str, Any] = {}
    facts: list[ModelFacts] = []
    for role in plans:
        if role.model_path not in configs:
            configs[role.model_path] = read_config(role.model_path, role.model_key)
        facts.append(ModelFacts.of(configs[role.model_path], role.head, role.model_key))
    plans = [size_auto_micro_batch(role, configs[role.model_path], role_facts.parameters, hardware) if role.micro_auto else role
             for role, role_facts in zip(plans, facts)]
    rollout_config, rollout_facts = None, None
    if "rollout" in config.present_roles:
        rollout_config = configs.get(config.model.path) or read_config(config.model.path, "model.path")
        rollout_facts = ModelFacts.of(rollout_config, "lm", "model.path")
    results: list[RoleResult] = []
    for role, role_facts in zip(plans, facts):
        model_config = configs[role.model_path]
        result = RoleResult(role, role_facts, role.step_flops(config_dict(model_config)))
        if role.not_planned:
            result.skipped = role.not_planned
        else:
            progress(f"planning {role.role} ({role_facts.architecture}, {role_facts.parameters:,} parameters)")
            _search(result, model_config, hardware, exact, tensor_parallel, progress)
        results.append(result)
    rollout = None
    if rollout_config is not None and rollout_facts is not None:
        needs = RolloutNeeds.of(config, rollout_config, rollout_facts)
        rollout = RolloutResult(needs, [plan_rollout(needs, t, hardware) for t in needs.tp_sizes(hardware)],
                                rollout_flops(config, config_dict(rollout_config), needs), config.rollout.backend)
    return PlanReport(hardware, config, results, rollout, exact, colocated(config, results, rollout, hardware))


def size_auto_micro_batch(role: RolePlan, model_config: Any, parameters: int, hardware: Hardware) -> RolePlan:
    """`role` with its `auto` token budget as its worker would size it on a device of `hardware`
    (`rlcore.workers.memory.size_micro_batch`, the per-token estimate `ActivationCost`): the device
    less the role's own parameters, gradients and AdamW state at its configured layout and the
    plan's headroom. Other roles sharing the device are not subtracted (the colocated summary
    shows them)."""
    cost = ActivationCost.of(config_dict(model_config), compute_bytes=2 if role.precision == "bf16" or role.param_dtype == torch.bfloat16 else 4,
                             checkpointing=role.checkpointing, head=role.head, chunk_tokens=role.chunk_tokens,
                             tensor_parallel=role.layout.tensor_parallel, sequence_parallel=role.layout.sequence_parallel)
    static = static_bytes(role, parameters, role.layout.world_size)
    choice = size_micro_batch(role.micro_key, device=f"devices of {gib(hardware.device_memory)}", total=hardware.device_memory,
                              available=hardware.device_memory - static, per_token=cost.per_token(role.trains), fixed=cost.fixed(),
                              margin=hardware.headroom,
                              free="free beside its parameters" + (", gradients and AdamW state" if role.trains else ""))
    rows = max(1, choice.tokens // role.micro.length)
    return replace(role, micro=replace(role.micro, rows=rows), micro_note=choice.reason)


def colocated(config: Config, results: list[RoleResult], rollout: RolloutResult | None, hardware: Hardware) -> Colocated | None:
    """The run with every role on all of `hardware`'s devices (see `Colocated`), each role at its
    lowest simulated peak there and the rollout at its smallest fitting tensor-parallel size; None
    when a role was not simulated on all devices."""
    on_all: dict[str, Tried] = {}
    for result in results:
        full = [t for t in result.tried if t.layout.devices == hardware.devices]
        if not full:
            return None
        on_all[result.role.role] = min(full, key=lambda t: t.peak.total)
    kept = {role: tried.peak.sharded for role, tried in on_all.items()}  # what a role keeps between its phases
    best = rollout.smallest if rollout is not None else None
    awake = best.total if best is not None else 0
    asleep = [(role, tried.peak.total + sum(v for r, v in kept.items() if r != role)) for role, tried in on_all.items()]
    mode = config.rollout.sleep
    sleeps, why = mode == "always", f"rollout.sleep={mode}"
    if mode == "auto":
        decision = sleep_decision(total=hardware.device_memory, engine_bytes=awake, margin=hardware.headroom, source="planned",
                                  update_peak=max((size for _, size in asleep), default=0))
        sleeps, why = decision.sleep, decision.reason
    phases = [(role, size + (0 if sleeps else awake)) for role, size in asleep]
    if best is not None:
        phases.append((f"rollout (TP {best.tp})", awake + sum(kept.values())))
    return Colocated(tuple(phases), sleeps, why)


def parallel_shapes(result: RoleResult, model_config: Any, hardware: Hardware, tensor_parallel: list[int] | None = None
                    ) -> list[tuple[int, int]]:
    """(sequence-parallel, tensor-parallel) sizes the role may use, ascending by TP then SP: powers of
    two (and the configured sizes) whose product divides a node's devices, that the model's shape
    takes (`tensor_parallel_problems`, `sequence_parallel_problem`, as `apply_layout` checks them); Ulysses only where the role has
    it, TP only where the architecture has a plan and the role no LoRA; `tensor_parallel` narrows
    the TP sizes."""
    role, g = result.role, hardware.devices_per_node
    shape = config_dict(model_config)
    sizes = {1 << k for k in range(g.bit_length())}
    sps = (sizes | {role.layout.sequence_parallel}) if role.sp_key is not None else {1}
    splittable = plan_source(shape) is not None and not role.lora
    tps = (sizes | {role.layout.tensor_parallel}) if splittable else {1}
    if tensor_parallel is not None:
        tps = set(tensor_parallel) if splittable else tps & set(tensor_parallel)
    return sorted(((sp, tp) for sp in sps for tp in tps if g % (sp * tp) == 0 and not tensor_parallel_problems(shape, tp)
                   and not sequence_parallel_problem(shape, sp, tp)), key=lambda st: (st[1], st[0]))


def _search(result: RoleResult, model_config: Any, hardware: Hardware, exact: bool, tensor_parallel: list[int] | None,
            progress: Callable[[str], None]) -> None:
    role, facts = result.role, result.facts
    cache: dict[Layout, Tried] = {}

    def run(layout: Layout) -> Tried:
        if layout not in cache:
            progress(f"  simulating {role.role} at {layout} ...")
            peak = simulate(role, model_config, layout, uniform=facts.uniform, exact=exact)
            cache[layout] = Tried(layout, peak, peak.total <= hardware.usable, result.step_flops / layout.devices)
            result.tried.append(cache[layout])
        return cache[layout]

    full = hardware.devices
    shapes = parallel_shapes(result, model_config, hardware, tensor_parallel)
    if not shapes:
        result.skipped = f"no tensor-parallel size in --tensor-parallel {tensor_parallel} suits the model ({facts.architecture})"
        return
    on_all = {(sp, tp): run(Layout(full // (sp * tp), sp, tp)) for sp, tp in shapes}
    configured = role.layout
    if 1 < configured.data_parallel * configured.sequence_parallel * configured.tensor_parallel <= full and \
            (configured.sequence_parallel, configured.tensor_parallel) in on_all:
        run(Layout(configured.data_parallel, configured.sequence_parallel, configured.tensor_parallel))  # the configured layout

    def predicted(layout: Layout) -> float:
        base = on_all[(layout.sp, layout.tp)].peak
        return base.total - base.sharded + base.sharded * full / layout.devices

    candidates = sorted((Layout(d // (sp * tp), sp, tp) for sp, tp in shapes for d in hardware.device_counts() if d % (sp * tp) == 0),
                        key=lambda lay: (lay.devices, lay.tp, lay.sp))
    candidates = [lay for lay in candidates if static_bytes(role, facts.parameters, lay.devices) <= hardware.usable
                  and predicted(lay) <= hardware.usable]
    confirmations = 0
    for layout in candidates:
        known = cache.get(layout)
        if known is None:
            if confirmations >= MAX_CONFIRMATIONS:
                break
            confirmations += 1
        tried = run(layout)
        if tried.fits:
            result.smallest = tried
            return
    fitting = [t for t in result.tried if t.fits]
    if fitting:
        result.smallest = min(fitting, key=lambda t: (t.layout.devices, t.layout.tp, t.layout.sp))
        return
    result.nowhere = _smallest_hardware(result, on_all, hardware, run)


def _smallest_hardware(result: RoleResult, on_all: dict[tuple[int, int], Tried], hardware: Hardware, run: Callable[[Layout], Tried]) -> str:
    """Why `result`'s role fits nowhere on `hardware`, and the smallest hardware that would fit it:
    more nodes of these devices (simulated to confirm), or larger devices."""
    role, full, usable, g = result.role, hardware.devices, hardware.usable, hardware.devices_per_node
    best = min(on_all.values(), key=lambda t: t.peak.total)
    bigger = math.ceil(best.peak.total / (1 - hardware.headroom) / 2**30)
    lines = [f"{role.role} fits nowhere on {hardware.devices} devices of {gib(hardware.device_memory)}: its lowest peak there is "
             f"{gib(best.peak.total)} per rank ({best.layout})."]
    options, beyond = [], False
    for (sp, tp), tried in on_all.items():
        rest, sharded_all = tried.peak.total - tried.peak.sharded, tried.peak.sharded * full
        if rest >= usable:
            continue
        nodes = math.ceil(sharded_all / (usable - rest) / g)
        for extra in range(3):  # confirm by simulation; FSDP's padding may need a node more
            n = max(nodes + extra, hardware.nodes + 1)
            if n * g > MAX_DEVICES:  # more than the planner simulates (`Hardware`)
                beyond = True
                break
            check = run(Layout(n * g // (sp * tp), sp, tp))
            if check.fits:
                options.append((n, check))
                break
    if options:
        n, check = min(options, key=lambda o: (o[0], o[1].layout.tp, o[1].layout.sp))
        lines.append(f"Smallest hardware that fits it: {n} nodes x {g} devices of {gib(hardware.device_memory)} "
                     f"({check.layout}: {gib(check.peak.total)} per rank), or devices of at least {bigger} GiB on "
                     f"{hardware.nodes} x {g}.")
    elif beyond:
        lines.append(f"Smallest hardware that fits it: more than {MAX_DEVICES:,} devices of {gib(hardware.device_memory)} "
                     f"(beyond what the planner simulates), or devices of at least {bigger} GiB on {hardware.nodes} x {g}.")
    else:
        lines.append(f"More devices do not help: what FSDP does not shard (activations, gathered layers) is "
                     f"{gib(min(t.peak.total - t.peak.sharded for t in on_all.values()))} per rank even at the largest "
                     f"sequence- and tensor-parallel sizes. Smallest hardware that fits it: devices of at least {bigger} GiB on "
                     f"{hardware.nodes} x {g}; or fewer tokens per micro-batch, or model.gradient_checkpointing=true.")
    return " ".join(lines)


__all__ = ["Colocated", "PlanReport", "RoleResult", "RolloutResult", "Tried", "colocated", "parallel_shapes", "plan_run",
           "size_auto_micro_batch"]
