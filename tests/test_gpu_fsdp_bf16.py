"""An FSDP2 bf16 actor update on one rank equals the same update done by hand without FSDP.

FSDP2 side: `ActorWorker.update_actor` on an fp32 model sharded over a 1-rank process group
with a bf16 mixed-precision policy (rlcore's own wrapping when `shard_model` honours
`actor.mixed_precision` at one rank, else the wrapper of benchmarks/gpu_check.py, which is what
the GPU check measures). Reference: a bf16 copy of the same fp32 weights runs the same loss;
its bf16 gradients, cast to fp32, go to the fp32 master weights and the same AdamW.

The reference casts parameters only: FSDP2's policy leaves buffers in fp32, and a plain
`.to(bfloat16)` would also round RoPE's inv_freq, which alone moves gradients by ~1% (as much as
bf16 vs fp32 compute), too much to tell a real bug apart.

Tolerances: loss 1e-5 absolute and gradients 1e-3 relative (L2, per parameter, after clipping):
both sides run the same bf16 kernels on the same bf16 values (on CPU they agree exactly), so only
kernel nondeterminism (atomics in e.g. the embedding backward on CUDA) separates them.
Parameters after one AdamW step: Adam's first step moves each entry by about lr * sign(grad), so
an entry whose tiny gradient flips sign may differ by up to 2 lr; the mean difference must stay
below 5% of lr.

The GPU test runs on CUDA with nccl; the same comparison runs on CPU with gloo (slow-marked).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3


def _gpu_check():
    name = "_rlcore_benchmarks_gpu_check"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _compare(tmp_path: Path, device: torch.device) -> None:
    from dataclasses import replace

    from rlcore.algos import get_policy_loss
    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.forward import response_log_probs
    from rlcore.workers.fsdp import is_sharded, to_full
    from rlcore.workers.loading import load_causal_lm
    from rlcore.workers.optim import build_optimizer, build_scheduler

    gc = _gpu_check()
    shapes = replace(gc.SMOKE, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024,
                     actor_seqs=8, actor_prompt_len=8, actor_response_len=8)
    model_dir, _ = gc.build_model_dir(shapes, tmp_path, device)
    train_file = gc.write_task(tmp_path, 16)
    cfg = gc.base_config(
        model_dir, train_file, tmp_path / "run", shapes, device.type,
        model__dtype="float32", data__train_batch_size=8, rollout__n=1,
        actor__ppo_mini_batch_size=8, actor__max_tokens_per_micro_batch=10_000,  # one micro-batch
        actor__fused_kernels=False, actor__mixed_precision="bf16", actor__optim__lr=LR,
    )
    batch = gc.actor_batch(shapes, shapes.vocab)

    # --- reference: bf16 compute copy, fp32 master weights, same loss and optimizer
    master = load_causal_lm(model_dir, "float32", device)
    compute = copy.deepcopy(master)
    for p in compute.parameters():  # parameters only: FSDP2's policy leaves buffers (RoPE inv_freq) fp32
        p.data = p.data.to(torch.bfloat16)
    on_dev = batch.to(device)
    logp, _ = response_log_probs(compute, on_dev, 1.0, backend="torch")
    old = logp.detach().float()  # ratio 1: no token is clipped, on either side
    batch.tensors["old_log_probs"] = old.cpu()
    mask = on_dev["response_mask"].float()
    a = cfg.actor
    loss, _ = get_policy_loss(a.policy_loss)(
        old, logp, on_dev["advantages"], mask, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
        global_token_count=float(mask.sum()), global_seq_count=float(len(batch)),
    )
    loss.backward()
    for pm, pc in zip(master.parameters(), compute.parameters()):
        pm.grad = pc.grad.float()
    start = {n: p.detach().clone() for n, p in master.named_parameters()}
    opt = build_optimizer(master, a.optim)
    torch.nn.utils.clip_grad_norm_(master.parameters(), a.optim.grad_clip)  # as update_actor does, in place
    ref_grads = {n: p.grad.clone() for n, p in master.named_parameters()}
    opt.step()

    # --- FSDP2, one rank, bf16 mixed precision, through the actor worker
    with gc.one_rank_process_group(device):
        worker = ActorWorker(role_spec(cfg, "actor"))
        worker.setup()
        if not is_sharded(worker.model):
            worker.model = gc.fsdp2_bf16(worker.model, device)
            worker.optimizer = build_optimizer(worker.model, a.optim)
            worker.scheduler = build_scheduler(worker.optimizer, a.optim, cfg.trainer.total_steps)
        metrics = worker.update_actor(batch, 1)  # one sample per prompt (rollout.n=1)
        got_grads = {n: to_full(p.grad).float() for n, p in worker.model.named_parameters()}
        got_params = {n: to_full(p.detach()).float() for n, p in worker.model.named_parameters()}

    assert metrics["actor/bad_updates"] == 0.0
    assert metrics["actor/pg_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        rel = ((got_grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert rel <= 1e-3, f"{name}: gradient relative error {rel:.3g}"
    for name, p_ref in master.named_parameters():
        moved = (p_ref.detach() - start[name]).abs().max().item()
        assert moved > 0.5 * LR, f"{name} did not move (max |delta| {moved:.3g}): the comparison would be vacuous"
        diff = (got_params[name] - p_ref.detach()).abs()
        assert diff.max().item() <= 2 * LR * 1.01, f"{name}: max param difference {diff.max().item():.3g}"
        assert diff.mean().item() <= 0.05 * LR, f"{name}: mean param difference {diff.mean().item():.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_bf16_update_matches_plain_bf16_on_cuda(tmp_path):
    _compare(tmp_path, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.slow
def test_fsdp2_bf16_update_matches_plain_bf16_on_cpu(tmp_path):
    _compare(tmp_path, torch.device("cpu"))
