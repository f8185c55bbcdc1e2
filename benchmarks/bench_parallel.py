"""Tensor parallelism: memory per rank, the weight sync's cost, and what vLLM's loaders take.

    ./dev python benchmarks/bench_parallel.py                 # all three parts
    ./dev python benchmarks/bench_parallel.py --part memory   # TP 1 / 2 / 4: bytes per rank vs 1/TP
    ./dev python benchmarks/bench_parallel.py --part sync     # resharding sync vs gather-everything
    ./dev python benchmarks/bench_parallel.py --part loaders  # vLLM TP=2: full tensors vs pre-sliced shards

memory: a Llama of ~28M parameters (hidden 512, 6 layers, 8 heads, SwiGLU 1408, vocabulary 8192,
untied head) trained one step by the real actor worker (`ActorWorker.update_actor`) at
`actor.layout.tensor_parallel` 1 (one process), 2 and 4 (gloo processes, FSDP2 over a data-parallel
size of 1). Each rank reports the bytes of its own shards of the parameters, of their gradients and
of the AdamW state, and its peak resident memory (`VmHWM`) above what it held before the model
loaded (the interpreter and libraries, which no parallelism shrinks); the theoretical figure is
the one-process number over TP (norm weights, replicated on every tensor-parallel rank, are why it
is not exact).

sync: the same model as the actor at four layouts (one process, FSDP 2, TP 2, FSDP x TP 2 x 2),
its weights streamed to the rollout bucket by bucket (`actor.weight_sync_bucket_mb`, 16 MB here)
two ways: the resharding sync rlcore runs (`gather_to_owner`: each rank's own shards, one gather
per bucket to the rank that hands it to the rollout) and the gather-everything path (every tensor
`full_tensor()`-ed on every rank, the whole model kept on rank 0: the `weights_for_rollout` call,
and every all-gather based sync). Per sync: bytes each actor rank sends and receives, the most
gathered bytes a rank held, and its peak RSS (`VmHWM` after the resharding sync, then after the
gather-everything one, in the same processes: the second can only add). Bytes each rollout rank
receives do not depend on the actor's layout: vLLM's loaders take full tensors (see `loaders`), so
every engine rank gets the whole model, whatever its tensor-parallel size.

loaders: a vLLM engine with tensor_parallel_size=2 on CPU (needs vllm), three times, each a fresh
engine given new weights, its greedy output compared with transformers' on them: (1) rlcore's
sync of full tensors, each engine rank slicing its own part; (2) each rank handed only its own
slices of the projection matrices (what a resharding sync would send), through the same reload
path; (3) the same with the linear layers marked `is_sharded_weight` (vLLM's switch for
pre-sharded checkpoints). What each rank's loader said is printed.

All ranks run one torch thread; the machine may be shared, so CPU seconds (user + system of the
spawned processes) are printed next to wall seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import socket
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.config import config_from_dict, role_spec
from rlcore.controller.dispatch import plan_dispatch
from rlcore.data.preference import sequence_tensors
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker
from rlcore.workers.fsdp import iter_full_state, plan_buckets
from rlcore.workers.parallel.reshard import SyncStats, gather_to_owner
from rlcore.workers.parallel.tensors import local

VOCAB = 8192
MB = 2**20
LAYOUTS = {"1": None, "FSDP 2": {"data_parallel": 2}, "TP 2": {"tensor_parallel": 2},
           "FSDP x TP 2x2": {"data_parallel": 2, "tensor_parallel": 2}}


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                       num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0)


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def config(model: Path, layout: dict | None):
    tree: dict[str, Any] = {"model": {"path": str(model)}, "data": {"train_files": ["unused.parquet"], "train_batch_size": 2},
                            "trainer": {"device": "cpu", "backend": "ray" if layout else "inprocess"},
                            "actor": {"ppo_mini_batch_size": 2, "weight_sync_bucket_mb": 16, "optim": {"lr": 1e-4}},
                            "rollout": {"n": 2}}
    if layout:
        tree["actor"]["layout"] = layout
    return config_from_dict(tree)


def rl_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    t = sequence_tensors([torch.randint(1, VOCAB, (48,), generator=g).tolist() for _ in range(4)],
                         [torch.randint(1, VOCAB, (16,), generator=g).tolist() for _ in range(4)], pad_id=0)
    n, r = t["responses"].shape
    t.update(advantages=torch.randn(n, 1, generator=g).expand(n, r).contiguous(), old_log_probs=torch.full((n, r), -9.0))
    return Batch(tensors=t)


def _my_share(worker: ActorWorker, batch: Batch) -> Batch:
    spec = worker.registered_methods()["update_actor"]
    return plan_dispatch(spec.dispatch, worker.world_size, (batch,), {}, "update_actor", spec.ranks_per_shard).calls[worker.rank][1][0]


def _bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def reset_peak() -> None:
    """Start the kernel's resident-set high-water mark (`VmHWM`) again from the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def memory_rank(rank: int, world: int, model: Path) -> dict:
    base = status_mb("VmRSS")
    worker = ActorWorker(role_spec(config(model, {"tensor_parallel": world} if world > 1 else None), "actor"), rank, world)
    worker.setup()  # every rank reads the whole checkpoint, then keeps its shards
    held = status_mb("VmRSS") - base
    reset_peak()
    worker.update_actor(_my_share(worker, rl_batch()), 2)
    params = list(worker.model.parameters())
    state = [v for s in worker.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params), "optim": _bytes(state),
            "held_mb": held, "peak_mb": status_mb("VmHWM") - base}


def sync_rank(rank: int, world: int, model: Path, layout: dict | None) -> dict:
    worker = ActorWorker(role_spec(config(model, layout), "actor"), rank, world)
    worker.setup()
    worker.update_actor(_my_share(worker, rl_batch()), 2)
    model_bytes = sum(t.numel() * t.element_size() for t in worker.model.state_dict().values())
    rss = status_mb("VmRSS")
    reset_peak()
    plan = plan_buckets(worker.model, worker._bucket_bytes)
    reshard = SyncStats()
    start = time.perf_counter()
    for names in plan:
        items, stats = gather_to_owner(worker.model, names, owner=0)
        reshard.add(stats)
        del items
    reshard_s, reshard_hwm = time.perf_counter() - start, status_mb("VmHWM") - rss
    # gather everything: every tensor all-gathered on every rank, rank 0 keeping the whole model
    start = time.perf_counter()
    kept, peak_transient, received = [], 0, 0
    for bucket in iter_full_state(worker.model, worker._bucket_bytes, keep=True):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        own = sum(_bytes([t]) for t in _own_shards(worker.model, [n for n, _ in bucket]))
        received += size - own if world > 1 else 0
        peak_transient = max(peak_transient, size)
        if rank == 0:
            kept.extend(bucket)
    kept_bytes = sum(t.numel() * t.element_size() for _, t in kept)
    gather_s, gather_hwm = time.perf_counter() - start, status_mb("VmHWM") - rss
    gather_peak = 0 if world == 1 else kept_bytes + (peak_transient if rank else 0)  # one process: views, no copies
    return {"model_bytes": model_bytes, "buckets": len(plan), "reshard": reshard, "reshard_s": reshard_s,
            "reshard_hwm_mb": reshard_hwm, "gather_received": received, "gather_peak": gather_peak, "gather_s": gather_s,
            "gather_hwm_mb": gather_hwm}


def _own_shards(model, names):
    state = model.state_dict()
    return [state[n] for n in names if n in state]


def _rank_main(rank: int, world: int, port: int, out: str, fn) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world)
    finally:
        if world > 1:
            dist.destroy_process_group()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    torch.save({**result, "cpu_s": usage.ru_utime + usage.ru_stime}, Path(out, f"rank{rank}.pt"))


def launch(fn, world: int, work: Path) -> tuple[list[dict], float]:
    out = Path(tempfile.mkdtemp(dir=work))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    mp.spawn(_rank_main, args=(world, port, str(out), fn), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)], time.perf_counter() - start


def part_memory(model: Path, work: Path) -> None:
    print("\n== memory per rank at tensor parallel 1 / 2 / 4 (one training step, AdamW) ==")
    rows = {}
    for tp in (1, 2, 4):
        ranks, wall = launch(partial(memory_rank, model=model), tp, work)
        rows[tp] = ranks
        print(f"  TP {tp}: {wall:.0f} s wall, {sum(r['cpu_s'] for r in ranks):.0f} s CPU over {tp} process(es)")
    one = rows[1][0]
    print("  per rank, measured (the largest rank) / theory (TP 1's over TP); RSS above the process before the model "
          "loaded: after setup (the shards held), and the peak of the training step")
    print(f"  {'':6} {'params MB':>16} {'grads MB':>16} {'AdamW MB':>16} {'RSS after setup MB':>19} {'step peak RSS MB':>17}")
    for tp, ranks in rows.items():
        cells = []
        for key in ("params", "grads", "optim", "held_mb", "peak_mb"):
            got = max(r[key] for r in ranks) / (MB if key in ("params", "grads", "optim") else 1)
            want = one[key] / (MB if key in ("params", "grads", "optim") else 1) / tp
            cells.append(f"{got:7.1f} / {want:6.1f}")
        print(f"  TP {tp}: {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {cells[3]:>19} {cells[4]:>17}"
              f"   (parameters x{max(r['params'] for r in ranks) / one['params']:.3f} of TP 1)")


def part_sync(model: Path, work: Path) -> None:
    print("\n== one weight sync (buckets of 16 MB) from each actor layout: resharding vs gather-everything ==")
    for name, layout in LAYOUTS.items():
        world = 1 if layout is None else math.prod(layout.values())
        ranks, wall = launch(partial(sync_rank, model=model, layout=layout), world, work)
        mb = ranks[0]["model_bytes"] / MB
        print(f"  actor {name} ({world} rank{'s' if world > 1 else ''}, model {mb:.1f} MB, {ranks[0]['buckets']} buckets; "
              f"{wall:.0f} s wall, {sum(r['cpu_s'] for r in ranks):.0f} s CPU)")
        for r, res in enumerate(ranks):
            s: SyncStats = res["reshard"]
            print(f"    rank {r}: resharding sends {s.sent_bytes / MB:6.1f} MB, receives {s.received_bytes / MB:6.1f} MB, "
                  f"holds at most {s.peak_bytes / MB:6.1f} MB, peak RSS +{res['reshard_hwm_mb']:5.0f} MB, {res['reshard_s']:.2f} s | "
                  f"gather-everything receives {res['gather_received'] / MB:6.1f} MB, holds at most {res['gather_peak'] / MB:6.1f} MB, "
                  f"peak RSS +{res['gather_hwm_mb']:5.0f} MB, {res['gather_s']:.2f} s")
    print("  each rollout rank receives the whole model per sync (vLLM's loaders take full tensors; with "
          "rollout.layout.tensor_parallel=T every one of an engine's T ranks gets all of it): see --part loaders")


# ----- vLLM's loaders ---------------------------------------------------------------------------

ROW_PARALLEL = ("o_proj", "down_proj")  # split along their input dim (1); the other projections along dim 0


def _presliced(worker: Any, full: list[tuple[str, torch.Tensor]], flag: bool) -> str:
    """In each vLLM rank, through rlcore's reload path (`rlcore.rollout.vllm._reload_*`): every
    projection matrix sliced for this rank as vLLM partitions it, embeddings and norms whole.
    `flag`: mark the linear layers' parameters `is_sharded_weight` (vLLM's switch that stops its
    linear loaders from slicing again; its embedding loader has none)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from rlcore.rollout.vllm import _reload_finish, _reload_load, _reload_open

    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    model = worker.model_runner.get_model()
    _reload_open(worker)
    if flag:
        for name, p in model.named_parameters():
            if "proj" in name:
                p.is_sharded_weight = True
    sliced = [(k, v.chunk(size, dim=1 if any(r in k for r in ROW_PARALLEL) else 0)[rank].clone() if "proj" in k else v)
              for k, v in full]
    try:
        _reload_load(worker, sliced)
        _reload_finish(worker)
        return f"rank {rank}: loaded"
    except Exception as err:  # noqa: BLE001 - the message is the evidence
        return f"rank {rank}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"


def part_loaders(work: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("\n== vLLM loaders: vllm is not installed, skipped ==")
        return
    from rlcore.protocol import Batch as _Batch
    from rlcore.rollout import SamplingParams
    from rlcore.rollout.vllm import VLLMRolloutEngine, tensor_parallel_binding

    print("\n== vLLM tensor_parallel_size=2 on CPU: full tensors per rank vs pre-sliced shards ==")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.4)
    a, b = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    a.save_pretrained(work / "a")
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    batch = _Batch(tensors={"input_ids": ids, "attention_mask": (ids != 0).long()})
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=8)
    want = [b.generate(ids[i][ids[i] != 0][None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, (ids[i] != 0).sum():].tolist() for i in range(2)]
    weights = [(n, p.detach()) for n, p in b.named_parameters()] + [("lm_head.weight", b.lm_head.weight.detach())]
    print(f"  thread binding of the engine's ranks: VLLM_CPU_OMP_THREADS_BIND={tensor_parallel_binding(2)!r} (an explicit "
          "setting, as ./dev's, is kept; else this process's cores, one group per rank)")
    for case in ("full", "sliced", "sliced+flag"):
        start = time.perf_counter()
        engine = VLLMRolloutEngine.from_pretrained(str(work / "a"), eos_token_ids=[], kv_cache_gib=0.125, max_model_len=128,
                                                   tensor_parallel_size=2)
        try:
            shapes = engine.llm.collective_rpc(_qkv_shape)
            if case == "full":
                engine.update_weights(weights)  # rlcore's sync: the same full tensors to every rank
                how = "full tensors to every rank (rlcore's sync)"
                loaded = ["every rank: loaded"]
            else:
                loaded = engine.llm.collective_rpc(_presliced, args=(weights, case == "sliced+flag"))
                engine.llm.reset_prefix_cache()
                how = "each rank its own slices" + (", marked is_sharded_weight" if case == "sliced+flag" else "")
            try:
                got = engine.generate(batch, greedy)["responses"].tolist()
                verdict = f"greedy output equals transformers' on the new weights: {got == want}"
            except Exception as err:  # noqa: BLE001
                verdict = f"generation failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            print(f"  {how}: {'; '.join(loaded)}; {verdict} (engine {time.perf_counter() - start:.0f} s; qkv_proj as "
                  f"served on each rank: {shapes})")
        finally:
            engine.close()
    print("  transport: vLLM's collective_rpc broadcasts one message that every rank reads in full, so even per-rank "
          "slices reach each rank whole; sending a rank only its shard needs vLLM's NCCL weight-transfer engines (GPU)")


def _qkv_shape(worker: Any) -> str:
    model = worker.model_runner.get_model()
    return str(tuple(dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "memory", "sync", "loaders"], default="all")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed tensors leave RSS (see bench_long_context)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="bench_parallel_") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        LlamaForCausalLM(model_config()).save_pretrained(work / "model")
        params = sum(p.numel() for p in LlamaForCausalLM(model_config()).parameters())
        print(f"Llama hidden 512, 6 layers, 8 heads, vocabulary {VOCAB}: {params / 1e6:.1f}M parameters "
              f"({params * 4 / MB:.0f} MB float32); torch {torch.__version__}, 1 thread per rank")
        if args.part in ("all", "memory"):
            part_memory(work / "model", work)
        if args.part in ("all", "sync"):
            part_sync(work / "model", work)
        if args.part in ("all", "loaders"):
            part_loaders(work)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nspawned processes' CPU: {cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.0f} s")


if __name__ == "__main__":
    main()
