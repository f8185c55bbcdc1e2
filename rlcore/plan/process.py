"""A rank's expected process resident memory (RSS), modelled from a few measured constants.

The simulation (`rlcore.plan.simulate`) counts tensors: the peak of the bytes torch's storages hold.
A process holds more, and `ps` / the OOM killer see that:

- the interpreter and its libraries (torch, transformers, rlcore's workers, the process group);
- what loading leaves: every rank builds the whole model (`from_pretrained`) before FSDP keeps its
  shard; glibc keeps much of the freed copy;
- the step's fixed overhead (kernels and modules loaded on first use, autograd's and gloo's
  buffers, Python objects), and glibc's retention of freed step buffers, which grows with the
  tensor peak (freed activations are kept in the heap, fragmented, not returned).

So: RSS = BASELINE + LOADING x model bytes + STEP_FIXED + RETENTION x tensor peak.

The constants are MEASURED, not simulated: `./dev python benchmarks/bench_plan_rss.py --calibrate`
on 2 gloo CPU ranks of this repository's test model (benchmarks/bench_plan.py's 7.1M-parameter
Llama, float32, glibc's default allocator settings, one OMP thread), each rank's VmRSS after
imports and process-group setup (BASELINE), after `ActorWorker.setup` less its shards (LOADING, per
byte of the whole model), and VmHWM after a warm-up and a measured step at two token budgets (the
line through the two (tensor peak, RSS growth) points: STEP_FIXED and RETENTION). They hold for a
CPU rank (tensors in host memory) on this software stack; on a GPU the tensor peak is device
memory and the host RSS is BASELINE + LOADING's part. They were measured on the actor's training
step; a forward-only role (reference, frozen reward model) gets the same formula, which its smaller
tensor peak keeps close but which was not measured apart. `benchmarks/bench_plan_rss.py` checks the
model against two models no test uses (README "Process resident memory": 0.97-1.08 of each rank's
measured peak RSS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.plan.roles import RolePlan
from rlcore.plan.simulate import Peak

MIB = 2**20
BASELINE = 942 * MIB  # VmRSS after `import torch, transformers, rlcore.workers.actor` and gloo's process group (measured)
LOADING = 1.15         # RSS left after loading, per byte of the whole model, beyond the rank's shard: 31 MiB for 27 MiB (measured)
STEP_FIXED = 70 * MIB  # RSS the first steps add beside their tensors: the line's intercept (measured)
RETENTION = 1.34       # RSS per byte of the tensor peak: the line's slope, 275 MiB more RSS for 204 MiB more tensors (measured)


@dataclass(frozen=True)
class ProcessRSS:
    """A rank's modelled resident memory, by cause (bytes)."""

    baseline: int
    loading: int
    step_fixed: int
    tensors: int

    @property
    def total(self) -> int:
        return self.baseline + self.loading + self.step_fixed + self.tensors


def process_rss(role: RolePlan, parameters: int, peak: Peak) -> ProcessRSS:
    """`role`'s modelled RSS on one CPU rank whose simulated tensor peak is `peak`."""
    model_bytes = parameters * (torch.finfo(role.param_dtype).bits // 8)
    return ProcessRSS(BASELINE, round(LOADING * model_bytes), STEP_FIXED, round(RETENTION * peak.total))


__all__ = ["BASELINE", "LOADING", "RETENTION", "STEP_FIXED", "ProcessRSS", "process_rss"]
