"""Several gloo processes running real workers as one worker group would, without Ray: each rank
builds its worker, and a call is dispatched and collected exactly as a group dispatches it
(`plan_dispatch` with the worker's own specs; the results all-gathered to every rank). One launch
runs a list of cases in the same processes (the process groups of each layout are made once).
With `backend="nccl"` each rank takes the GPU of its rank instead (the GPU-marked tests)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from net import free_port

from rlcore.controller import Worker
from rlcore.controller.dispatch import plan_dispatch


def call(worker: Worker, method: str, *args: Any) -> Any:
    """`worker`'s share of a group call `method(*args)`, and the collected result (every rank
    joins: the per-rank results are all-gathered, then collected as the group would)."""
    spec = worker.registered_methods()[method]
    plan = plan_dispatch(spec.dispatch, worker.world_size, args, {}, method, spec.ranks_per_shard)
    mine = [c for c in plan.calls if c[0] == worker.rank]
    result = getattr(worker, method)(*mine[0][1], **mine[0][2]) if mine else None
    if worker.world_size == 1:
        return plan.collect([result])
    results: list[Any] = [None] * worker.world_size
    dist.all_gather_object(results, result)
    return plan.collect([results[r] for r, _, _ in plan.calls])


def _rank_main(rank: int, world: int, port: int, out: str, run: Callable[[int, int], dict], backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run(rank, world)
    except BaseException:
        Path(out, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    torch.save(_to_cpu(result), Path(out, f"rank{rank}.pt"))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


# What every rank imports anyway: loaded once by the forkserver that `spawn` starts per test process.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "transformers",
            "rlcore.workers.actor", "rlcore.workers.critic", "gloo_ranks"]


def spawn(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, the ranks forked from a forkserver that has
    imported torch, transformers and the workers once (under the `spawn` start method each rank
    imports them itself, ~6 CPU s): still a clean process, with no threads and no process group,
    but with the environment variables the server started with (set none for the ranks alone)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def launch(run: Callable[[int, int], dict], world: int, out: Path, backend: str = "gloo") -> list[dict]:
    """`run(rank, world)` in `world` processes of a `backend` process group (a picklable
    module-level function); each rank's returned dict (moved to the CPU), in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        spawn(_rank_main, (world, free_port(), str(out), run, backend), world)
    except Exception as err:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error*.txt")))
        raise AssertionError(f"a gloo rank failed:\n{errors or err}") from None
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
