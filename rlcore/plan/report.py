"""The planner's answer as text: per role, the layouts simulated with their per-rank peaks, the
smallest that fits, FLOPs per step per rank; the rollout's tensor-parallel sizes."""

from __future__ import annotations

import torch

from rlcore.flops import peak_flops_for
from rlcore.plan.hardware import gib
from rlcore.plan.planner import PlanReport, RoleResult, RolloutResult
from rlcore.plan.process import BASELINE, LOADING, RETENTION, STEP_FIXED, process_rss
from rlcore.plan.simulate import DEPTHS
from rlcore.plan.torch_api import TESTED_TORCH
from rlcore.rollout_backends import traits_of as backend_traits

# The tensor peak's parts at its moment (`rlcore.plan.torch_api.KINDS`), as the table names them.
KIND_COLUMNS = (("params", "params"), ("grads", "grad shard"), ("grads in flight", "grads in flight"), ("optimizer", "AdamW"),
                ("activations", "activations"), ("gathered", "gathered"))
LEGEND = ("  tensor peak: the per-rank peak of torch's tensors (simulated: fake tensors, see above); its parts at that moment: "
          "params and grad shard (this rank's share, 1/devices), grads in flight (FSDP's gradients of the layers being "
          "reduced, gathered over FSDP, split by TP only, and the reduce-scatter buffers), AdamW state, activations, gathered "
          "(FSDP's unsharded layers)",
          f"  process RSS: a CPU rank's resident memory, modelled (not simulated): the tensor peak x {RETENTION} + "
          f"{BASELINE // 2**20} MiB interpreter and libraries + {STEP_FIXED // 2**20} MiB first-step overhead + {LOADING} x the "
          "model's bytes left by loading; constants measured on 2 gloo ranks (rlcore/plan/process.py, benchmarks/bench_plan_rss.py)")


def parameters(count: int) -> str:
    """70.55B, 7.6M, 0.30M."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def _seconds(flops: float, device: str | None) -> str:
    peak = peak_flops_for(device) if device else None
    return f" ({flops / peak:.2f} s at {device}'s bf16 peak)" if peak else ""


def _role_header(result: RoleResult) -> str:
    role, m = result.role, result.role.micro
    if role.trains:
        precision = ("bf16 compute over " if role.precision == "bf16" else "") + f"{str(role.param_dtype).removeprefix('torch.')} weights"
        what = f"trained: {precision}, gradients and AdamW state; gradient checkpointing {'on' if role.checkpointing else 'off'}"
    else:
        what = f"forward only, {str(role.param_dtype).removeprefix('torch.')}"
    return f"{role.role} ({result.facts.architecture}, {parameters(result.facts.parameters)} parameters; {what}; micro-batch {m.describe()})"


def render_role(result: RoleResult, device: str | None) -> list[str]:
    lines = [_role_header(result)]
    if result.role.micro_note:
        lines.append(f"  {result.role.micro_note}")
    if result.role.caveat:
        lines.append(f"  note: {result.role.caveat}")
    if result.skipped:
        return [*lines, f"  not planned: {result.skipped}"]
    head = f"  {'layout':<30}{'devices':>8}{'tensor peak':>13}" + "".join(f"{name:>16}" for _, name in KIND_COLUMNS)
    lines += [head + f"{'process RSS':>13}{'fits':>6}  FLOPs/step/rank"]
    for t in sorted(result.tried, key=lambda t: (t.layout.devices, t.layout.tp, t.layout.sp)):
        kinds = "".join(f"{gib(t.peak.kinds.get(k, 0)):>16}" for k, _ in KIND_COLUMNS)
        rss = process_rss(result.role, result.facts.parameters, t.peak).total
        lines.append(f"  {str(t.layout):<30}{t.layout.devices:>8}{gib(t.peak.total):>13}{kinds}{gib(rss):>13}"
                     f"{'yes' if t.fits else 'no':>6}  {t.flops_per_rank:.3g}{_seconds(t.flops_per_rank, device)}")
    if result.smallest is not None:
        s = result.smallest
        lines.append(f"  smallest that fits: {s.layout}, {gib(s.peak.total)} tensor peak per rank ({s.layout.keys(result.role.role)})")
    if result.nowhere:
        lines.append(f"  {result.nowhere}")
    return lines


def render_rollout(rollout: RolloutResult, device: str | None, devices: int) -> list[str]:
    n = rollout.needs
    dtype = {2: "bfloat16", 4: "float32"}[n.dtype_bytes]
    note = backend_traits(rollout.backend).plan_note  # the planner models every engine as vLLM
    backend = f"vLLM (rollout.backend={rollout.backend}, {note})" if note else "vLLM"
    lines = [f"rollout ({backend}, {dtype}; sequences up to {n.sequence_tokens:,} tokens, {n.step_sequences:,} per step; "
             f"KV blocks of {n.block_size}, up to {n.max_num_seqs} sequences at once)"]
    per_rank = rollout.step_flops / devices
    for p in rollout.plans:
        lines.append(f"  TP {p.tp} x {p.replicas} replica{'s' * (p.replicas > 1)}: weights {gib(p.weights)} + KV cache "
                     f"{gib(p.kv_cache)} per device; holds {p.concurrent:,} full-length sequences at once "
                     f"(wants {p.wanted:,}): {'fits' if p.fits else 'does not fit'} ({p.why})")
    best = rollout.smallest
    if best is None:
        lines.append(f"  the rollout fits at no tensor-parallel size within a node of {devices} devices")
    else:
        queue = "" if best.concurrent >= best.wanted else f"; its replicas queue sequences ({best.concurrent} of {best.wanted} at once)"
        lines.append(f"  smallest that fits: TP {best.tp}{queue} (rollout.layout.tensor_parallel={best.tp})")
    lines.append(f"  FLOPs/step/rank on all {devices} devices: {per_rank:.3g}{_seconds(per_rank, device)}")
    return lines


def render(report: PlanReport, config_path: str, device: str | None = None) -> str:
    hw = report.hardware
    how = ("every layer simulated" if report.exact
           else f"uniform decoder stacks extrapolated from {DEPTHS[0]} and {DEPTHS[1]} simulated layers")
    lines = [f"rlcore plan {config_path}: {hw.describe()}",
             f"per-rank tensor peaks simulated with fake tensors on torch's fake process group (torch {torch.__version__}, "
             f"checked with {TESTED_TORCH}; {how}); every sequence at its maximum length; not measured; a layout fits when "
             "its tensor peak does", *LEGEND, ""]
    for result in report.roles:
        lines += [*render_role(result, device), ""]
    if report.rollout is not None:
        lines += [*render_rollout(report.rollout, device, hw.devices), ""]
    lines.append("summary:")
    for result in report.roles:
        if result.skipped:
            lines.append(f"  {result.role.role}: not planned ({result.skipped})")
        elif result.smallest is not None:
            lines.append(f"  {result.role.role}: fits, smallest {result.smallest.layout} ({gib(result.smallest.peak.total)} tensor peak per rank)")
        else:
            lines.append(f"  {result.role.role}: DOES NOT FIT on this hardware (see above)")
    if report.rollout is not None:
        best = report.rollout.smallest
        lines.append(f"  rollout: {'fits, smallest TP ' + str(best.tp) if best else 'DOES NOT FIT on this hardware'}")
    if report.colocated is not None:
        lines += ["", *render_colocated(report)]
    return "\n".join(lines)


def render_colocated(report: PlanReport) -> list[str]:
    c, hw = report.colocated, report.hardware
    assert c is not None
    what, peak = c.peak
    sleep = "asleep" if c.rollout_sleeps else "awake"
    lines = [f"all roles on all {hw.devices} devices at once (one Ray pool; the rollout {sleep} while the others run): "
             f"peak {gib(peak)} per device, in the {what} phase: {'fits' if peak <= hw.usable else 'DOES NOT FIT'}",
             f"  {c.why}"]
    lines += [f"  {phase:<20} {gib(size):>12}" for phase, size in c.phases]
    return lines


__all__ = ["render", "render_role", "render_rollout"]
