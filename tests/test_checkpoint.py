"""Checkpoint folders: atomic, verified, pruned; damaged ones never picked up."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from rlcore.checkpoint import MANIFEST, CheckpointError, CheckpointManager, file_sha256, step_of


def _writer(payload: bytes):
    def write(folder):
        (folder / "model").mkdir()
        (folder / "model" / "weights.bin").write_bytes(payload)
        torch.save({"state": 1}, folder / "trainer_state.pt")

    return write


def test_latest_is_newest_complete(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _writer(b"a"))
    mgr.save(2, _writer(b"bb"))
    assert step_of(mgr.latest()) == 2
    assert (mgr.latest() / "model" / "weights.bin").read_bytes() == b"bb"


def test_keep_last_prunes_older(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _writer(b"x"))
    assert [step_of(p) for p in mgr.complete()] == [3, 4]


def test_partial_checkpoint_is_never_picked_up(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _writer(b"a"))

    def crash(folder):
        (folder / "half").write_bytes(b"...")
        raise KeyboardInterrupt  # killed mid-save

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, crash)
    # a folder named like a checkpoint but without a manifest is ignored too
    (tmp_path / "step_00000003").mkdir()
    assert step_of(mgr.latest()) == 1


def test_damaged_checkpoint_is_skipped_with_reason(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _writer(b"good"))
    newest = mgr.save(2, _writer(b"good-too"))
    with open(newest / "model" / "weights.bin", "r+b") as f:
        f.truncate(2)
    with pytest.raises(CheckpointError, match=r"weights.bin has 2 bytes"):
        mgr.verify(newest)
    assert step_of(mgr.latest()) == 1
    (newest / "model" / "weights.bin").write_bytes(b"good-too")
    os.remove(newest / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="missing file trainer_state.pt"):
        mgr.verify(newest)


def test_step_of_rejects_other_folders(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        step_of(tmp_path / "latest")


def test_pruning_never_removes_the_newest_healthy_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _writer(b"a"))
    mgr.save(2, _writer(b"b"), healthy=False)
    mgr.save(3, _writer(b"c"), healthy=False)
    assert [step_of(p) for p in mgr.complete()] == [1, 3]
    assert step_of(mgr.newest_healthy()) == 1
    mgr.save(4, _writer(b"d"))
    assert [step_of(p) for p in mgr.complete()] == [4]


def test_a_changed_file_of_the_same_size_fails_its_hash(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _writer(b"good"))
    newest = mgr.save(2, _writer(b"same"))
    (newest / "model" / "weights.bin").write_bytes(b"SAME")
    with pytest.raises(CheckpointError, match=r"step_00000002: file model/weights.bin does not match its SHA-256"):
        mgr.verify(newest)
    assert step_of(mgr.latest()) == 1


class _Payload:
    """Unpickling this runs code: it creates the file named in it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _forge(checkpoint: Path, rel: str, content: bytes) -> None:
    """Replace a file and rewrite the manifest to match (an attacker with write access)."""
    (checkpoint / rel).write_bytes(content)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][rel] = {"size": len(content), "sha256": file_sha256(checkpoint / rel)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("format", ["raw pickle", "torch.save archive"])
def test_a_pickle_in_a_state_file_is_refused_in_one_line_and_the_older_checkpoint_used(tmp_path, format):
    """Even with the manifest rewritten to match, a .pt file holding more than data is refused
    when the checkpoint is verified, before anything loads it: one line naming the folder and
    file, not torch's "Weights only load failed" text; `latest` falls back past it."""
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    mgr.save(1, _writer(b"a"))
    newest = mgr.save(2, _writer(b"b"))
    marker = tmp_path / "code-ran"
    if format == "raw pickle":
        content = pickle.dumps({"state": _Payload(marker)})
    else:
        torch.save({"state": _Payload(marker)}, tmp_path / "payload.pt")
        content = (tmp_path / "payload.pt").read_bytes()
    _forge(newest, "trainer_state.pt", content)
    with pytest.raises(CheckpointError) as info:
        mgr.verify(newest)
    message = str(info.value)
    assert message.startswith(f"{newest}: file trainer_state.pt ") and "\n" not in message, message
    assert ("not a torch.save archive" if format == "raw pickle" else "holds more than plain data") in message, message
    assert "Weights only load failed" not in message and not marker.exists()
    assert step_of(mgr.latest()) == 1 and not marker.exists()


def test_a_trainer_state_without_what_the_run_restores_is_damaged_for_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, state_keys=("train_loader",))
    good = {"step": 1, "rng": {}, "train_loader": {"epoch": 0}}
    mgr.save(1, lambda folder: (folder / "trainer_state.json").write_text(json.dumps(good)))
    newest = mgr.save(2, lambda folder: (folder / "trainer_state.json").write_text(json.dumps(good)))
    _forge(newest, "trainer_state.json", json.dumps({"step": 2, "rng": {}}).encode())
    with pytest.raises(CheckpointError, match=r"step_00000002: file trainer_state.json lacks 'train_loader'"):
        mgr.verify(newest)
    assert step_of(mgr.latest()) == 1


def test_a_forged_lora_adapter_of_another_rank_is_named_before_it_loads(tiny_example, tmp_path):
    """An adapter rewritten with rank-4 tensors (manifest to match) for a rank-8 run: one line naming
    the checkpoint, the file and the setting, instead of peft's raw `size mismatch for ...lora_A...`."""
    from safetensors.torch import save_file

    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.trainer.run_state import RunCheckpoints, checkpoint_policy

    config = load_config(CONFIG_DIR / "tiny_grpo_lora.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run")))
    checks = RunCheckpoints(checkpoint_policy(config), tmp_path / "run", groups=None, algorithm="grpo", state={})  # type: ignore[arg-type]
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    (step / "actor_adapter").mkdir(parents=True)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    for rank in (8, 4):
        save_file({name.format("A"): torch.zeros(rank, 128), name.format("B"): torch.zeros(128, rank)},
                  step / "actor_adapter" / "adapter_model.safetensors")
        problem = checks._weights_problem(step)
        if rank == 8:
            assert problem is None
    assert problem == (f"{step}: file actor_adapter/adapter_model.safetensors does not fit this run's adapter: tensor "
                       f"{name.format('A')} is [4, 128], of rank 4; this run's actor.lora.rank is 8")
