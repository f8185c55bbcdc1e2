"""On a CUDA device: `actor.max_tokens_per_micro_batch: auto` is sized from the device's free
memory and said once, the per-token activation formula covers what the caching allocator really
holds per token of a micro-batch, and a rollout engine's sleep reports the bytes it released (what
`rollout.sleep: auto` weighs). Skipped without CUDA; the same logic is tested on the CPU with given
numbers in `tests/test_memory_budget.py`."""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[1]
KEY = "actor.max_tokens_per_micro_batch"


def _gpu_check():
    name = "_rlcore_benchmarks_gpu_check"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _setup(tmp_path: Path, **extra):
    gc = _gpu_check()
    shapes = replace(gc.SMOKE, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=4096, max_positions=4096,
                     actor_seqs=16, actor_prompt_len=64, actor_response_len=192)
    model_dir, _ = gc.build_model_dir(shapes, tmp_path, torch.device("cuda"))
    cfg = gc.base_config(model_dir, gc.write_task(tmp_path, 16), tmp_path / "run", shapes, "cuda", model__dtype="float32",
                         data__train_batch_size=shapes.actor_seqs, actor__ppo_mini_batch_size=shapes.actor_seqs, rollout__n=1,
                         actor__mixed_precision="bf16", actor__fused_kernels=False, **extra)
    return gc, shapes, cfg


def test_auto_is_sized_on_the_device_said_once_and_the_update_reports_its_peak(tmp_path, caplog):
    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker

    gc, shapes, cfg = _setup(tmp_path)
    assert cfg.actor.max_tokens_per_micro_batch == "auto"
    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    with caplog.at_level(logging.INFO, logger="rlcore.workers.memory"):
        for _ in range(2):
            metrics = worker.update_actor(gc.actor_batch(shapes, shapes.vocab), 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{KEY}=auto:")]
    assert len(lines) == 1 and " tokens on cuda" in lines[0] and ": (" in lines[0], lines
    assert worker.budget is not None and worker.budget.tokens >= 4096  # a small model on a large device
    total = torch.cuda.mem_get_info()[1]
    assert 0 < metrics["memory/actor_update_device_peak_gib"] * 2**30 <= total


def test_the_formula_covers_the_activations_the_allocator_holds_per_token(tmp_path):
    """Two updates of one micro-batch each, of N and N/2 tokens: the growth of the device-wide peak
    per token is what a micro-batch costs per token; the formula must cover it (the margin takes
    the rest) and not overshoot it by more than half."""
    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.memory import PeakMeter, role_cost

    gc, shapes, cfg = _setup(tmp_path, actor__max_tokens_per_micro_batch=1_000_000)
    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    full = gc.actor_batch(shapes, shapes.vocab)
    half = full.take(list(range(shapes.actor_seqs // 2)))
    worker.update_actor(full, 1)  # AdamW's state and the allocator's first growth
    peaks = {}
    for name, batch in (("full", full), ("half", half)):
        torch.cuda.empty_cache()
        with PeakMeter(torch.device("cuda")) as meter:
            worker.update_actor(batch, 1)
        peaks[name] = meter.peak
    tokens = int(full["attention_mask"].sum()) - int(half["attention_mask"].sum())
    measured = (peaks["full"] - peaks["half"]) / tokens
    estimate = role_cost(worker.spec).per_token()
    print(f"per token: measured {measured:,.0f} bytes, formula {estimate:,.0f} ({estimate / measured:.2f}x)")
    assert measured <= estimate <= 1.5 * measured


def test_an_engine_on_the_gpu_reports_what_sleeping_released(tmp_path):
    from rlcore.config import role_spec
    from rlcore.workers.rollout import RolloutWorker

    _, _, cfg = _setup(tmp_path)
    worker = RolloutWorker(role_spec(cfg, "rollout"))
    worker.setup()
    weights = sum(p.numel() * p.element_size() for p in worker.engine.model.parameters())
    released = worker.sleep()
    worker.wake()
    assert released["device_total_bytes"] == torch.cuda.mem_get_info()[1]
    assert 0.9 * weights <= released["released_bytes"] <= weights + 64 * 2**20
