"""Checkpoints move between layouts: an actor saved at FSDP x TP = 2 x 2 resumes at tensor parallel
2 (1 x 2), at data parallel 2 (2 x 1) and in one process, and one saved in one process resumes at
2 x 2, each taking the same next step (metrics and updated weights) as the run that never moved;
the Hugging Face folder a 2 x 2 checkpoint holds is one safetensors folder that transformers loads
as the trained model (tied embeddings stored once). Qwen2 with grouped-query attention and tied
embeddings; gloo ranks (`gloo_ranks`), one launch of 4 and one of 2 processes."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from gloo_ranks import call, launch  # tests/ is on sys.path
from test_tensor_parallel import LR, SAMPLES_PER_PROMPT, rl_batch, role_config, save_models
from transformers import AutoModelForCausalLM

from rlcore.config import role_spec
from rlcore.workers.actor import ActorWorker
from rlcore.workers.fsdp import to_full

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ARCH = "qwen2-gqa"
FSDP_TP, TP, DP = {"data_parallel": 2, "tensor_parallel": 2}, {"tensor_parallel": 2}, {"data_parallel": 2}


def _worker(root: Path, layout: dict | None, rank: int, world: int, checkpoint: Path | None = None) -> ActorWorker:
    worker = ActorWorker(role_spec(role_config(root, "actor", ARCH, layout), "actor"), rank, world)
    if checkpoint is None:
        worker.setup()
    else:
        worker.load_checkpoint(str(checkpoint))
    return worker


def _step(worker: ActorWorker) -> dict:
    """One update (two optimizer steps) and the weights it leaves, as every rank sees them."""
    batch = rl_batch()
    old = call(worker, "compute_log_prob", batch)
    metrics = call(worker, "update_actor", batch.union(old.select("old_log_probs")), SAMPLES_PER_PROMPT)[0]
    weights = {n: to_full(p.detach()).clone() for n, p in worker.model.named_parameters()}
    return {"metrics": {k: v for k, v in metrics.items() if not k.startswith("perf/")}, "weights": weights}


def _save(worker: ActorWorker, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    call(worker, "save_checkpoint", str(folder))


def _four(rank: int, world: int, root: Path, work: Path) -> dict:
    """2 x 2: a first step saved; and the one-process checkpoint resumed."""
    first = _worker(root, FSDP_TP, rank, world)
    _step(first)
    _save(first, work / "ckpt_2x2")
    resumed = _worker(root, FSDP_TP, rank, world, work / "ckpt_1")
    return {"from_1": _step(resumed)}


def _two(rank: int, world: int, root: Path, work: Path) -> dict:
    """The 2 x 2 checkpoint resumed at 1 x 2 and 2 x 1."""
    return {name: _step(_worker(root, layout, rank, world, work / "ckpt_2x2")) for name, layout in (("tp", TP), ("dp", DP))}


def _same(got: dict, want: dict, what: str) -> None:
    for name, value in want["metrics"].items():
        assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{what}: {name}"
    for name, w in want["weights"].items():  # AdamW's running moments came through the move too: 2 more steps
        diff = (got["weights"][name] - w).abs().max()
        assert float(diff) <= 4 * LR * 1e-2, f"{what}: {name} differs by {float(diff):.3g}"


def test_a_checkpoint_moves_between_layouts_and_takes_the_same_next_step(tmp_path):
    root = save_models(tmp_path / "models")
    work = tmp_path / "work"
    one = _worker(root, None, 0, 1)
    _step(one)
    _save(one, work / "ckpt_1")
    want = _step(one)  # the run that never moved: its second update
    assert want["metrics"]["actor/grad_norm"] > 0

    four = launch(partial(_four, root=root, work=work), 4, tmp_path / "out4")
    for r, got in enumerate(four):
        _same(got["from_1"], want, f"one process -> 2x2, rank {r}")
    # the 2 x 2 checkpoint: a safetensors folder transformers loads, tied head stored once
    folder = work / "ckpt_2x2" / "actor"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"] and (folder / "config.json").is_file()
    served = AutoModelForCausalLM.from_pretrained(folder)
    assert served.lm_head.weight is served.model.embed_tokens.weight
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    moved = _worker(root, None, 0, 1, work / "ckpt_2x2")  # 2 x 2 -> one process
    for name, p in moved.model.named_parameters():  # the folder and the distributed checkpoint agree
        torch.testing.assert_close(dict(served.named_parameters())[name], p.detach(), atol=0, rtol=0, msg=name)
    _same(_step(moved), want, "2x2 -> one process")

    two = launch(partial(_two, root=root, work=work), 2, tmp_path / "out2")
    for r, got in enumerate(two):
        _same(got["tp"], want, f"2x2 -> 1x2, rank {r}")
        _same(got["dp"], want, f"2x2 -> 2x1, rank {r}")
