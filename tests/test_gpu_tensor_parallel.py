"""The tensor-parallel layouts of `test_tensor_parallel.py` and `test_layout_checkpoints.py` on
GPUs over NCCL: a training step of actor, critic and reward model at TP=2, FSDP x TP = 2x2 and
TP + Ulysses equals the one-GPU step, and a 2x2 checkpoint resumes at TP=2 with the same next step.
Skipped without enough CUDA devices (2 for TP=2, 4 for the 2x2 layouts). Never run on a GPU here:
written for a machine with them (the CPU runs of the same comparisons are the gloo tests)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from gloo_ranks import _to_cpu, launch  # tests/ is on sys.path
from test_tensor_parallel import CASES_4, EVERY_TP_2, _run_cases, check_step, run_role, save_models

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices (NCCL ranks one per GPU)")


@pytest.mark.parametrize("world, cases", [(2, EVERY_TP_2), (4, CASES_4)], ids=["tp2", "fsdp2xtp2-and-tp2+sp2"])
def test_a_tensor_parallel_step_on_gpus_equals_the_one_gpu_step(tmp_path, world, cases):
    _gpus(world)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls as on the CPU (the tolerances assume it)
    root = save_models(tmp_path / "models")
    ranks = launch(partial(_run_cases, root=root, cases=cases, device="cuda"), world, tmp_path / "out", backend="nccl")
    for role, arch, layout in cases:
        want = _to_cpu(run_role(root, role, arch, None, device="cuda"))
        for r, got in enumerate(ranks):
            check_step(got[role, arch, str(layout)], want, f"{role} {arch} {layout} rank {r} (nccl)")
