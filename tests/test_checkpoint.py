"""Checkpoint folders: atomic, verified, pruned; damaged ones never picked up."""

import os

import pytest

from rlcore.checkpoint import CheckpointError, CheckpointManager, step_of


def _writer(payload: bytes):
    def write(folder):
        (folder / "model").mkdir()
        (folder / "model" / "weights.bin").write_bytes(payload)
        (folder / "trainer_state.pt").write_bytes(b"state")

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
