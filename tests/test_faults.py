"""Faults and hostile input around a run's state: never train from a broken checkpoint, never run
code from a file, survive torn logs, stop an exploding model before it is saved."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.checkpoint import MANIFEST, CheckpointError, CheckpointManager, file_sha256, step_of
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import ConfigError, load_config
from rlcore.tracking import read_jsonl, truncate_jsonl
from rlcore.trainer.run import make_trainer
from rlcore.trainer.run_state import TrainingStopped

pytestmark = pytest.mark.slow

QUICK = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.val_batch_size=64",
    "trainer.val_every=100", "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "rollout.backend=hf",
    "rollout.max_new_tokens=8", "trainer.trace=false", SCORE_IN_PROCESS,
]


def _config(example, out: Path, *extra: str):
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(example, str(out)) + QUICK + list(extra))


@pytest.fixture(scope="module")
def two_checkpoints(tiny_example, tmp_path_factory) -> Path:
    """A real 2-step GRPO run with a checkpoint after each step (copied per test before damage)."""
    out = tmp_path_factory.mktemp("faults") / "run"
    make_trainer(_config(tiny_example, out, "trainer.total_steps=2", "trainer.save_every=1", "trainer.keep_last=2")).fit()
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _zero_block(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(min(4096, path.stat().st_size // 2))
        f.write(b"\0" * min(65536, path.stat().st_size // 4))


def _random_bytes(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(min(4096, path.stat().st_size // 4)))


def _bad_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = b"{garbage"
    path.write_bytes(bytes(data))


def _wrong_size(path: Path) -> None:
    path.write_bytes(os.urandom(17))


def _right_size_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE = {"zeroed block": _zero_block, "random bytes": _random_bytes, "bad header": _bad_header,
          "wrong-size garbage": _wrong_size, "right-size garbage": _right_size_garbage}


def _state_files(checkpoint: Path) -> list[str]:
    return sorted(json.loads((checkpoint / MANIFEST).read_text())["files"])


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_damaged_file_falls_back_to_the_intact_checkpoint(two_checkpoints, tmp_path, damage):
    run = _copy(two_checkpoints, tmp_path)
    manager = CheckpointManager(run / "checkpoints")
    newest = manager.path_for(2)
    files = [f for f in _state_files(newest) if f.endswith((".safetensors", ".pt", ".json")) and "tokenizer" not in f]
    assert any(f.endswith("model.safetensors") for f in files) and "trainer_state.json" in files
    for rel in files:
        pristine = (newest / rel).read_bytes()
        DAMAGE[damage](newest / rel)
        with pytest.raises(CheckpointError, match=rf"step_00000002: file {rel}"):
            manager.verify(newest)
        assert step_of(manager.latest()) == 1, rel
        (newest / rel).write_bytes(pristine)
    assert step_of(manager.latest()) == 2


def test_resume_trains_on_from_the_intact_checkpoint_and_stops_when_none_is(two_checkpoints, tiny_example, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step_00000002"
    _zero_block(newest / "actor" / "model.safetensors")
    history = make_trainer(_config(tiny_example, run, "trainer.total_steps=3", "trainer.save_every=1")).fit()
    assert len(history) == 2  # steps 2 and 3 again, from step 1's checkpoint
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]

    for step in (2, 3):  # step 1 was pruned (keep_last=2): damage both that remain
        _right_size_garbage(run / "checkpoints" / f"step_{step:08d}" / "trainer_state.json")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step_00000003: file trainer_state.json"):
        make_trainer(_config(tiny_example, run, "trainer.total_steps=4")).fit()


class _Payload:
    """Unpickling this runs code: it creates the file named in it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_in_a_state_file_is_refused_and_never_runs(two_checkpoints, tiny_example, tmp_path):
    """Even with its manifest rewritten to match (an attacker with write access), no file of a
    checkpoint is unpickled: .pt files load with weights_only=True, the trainer state is JSON."""
    run = _copy(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "code-ran"
    pristine_manifest = (newest / MANIFEST).read_text()
    for rel in [f for f in _state_files(newest) if f.endswith((".pt", "trainer_state.json"))]:
        pristine = (newest / rel).read_bytes()
        (newest / rel).write_bytes(pickle.dumps({"state": _Payload(marker)}))
        manifest = json.loads((newest / MANIFEST).read_text())
        manifest["files"][rel] = {"size": (newest / rel).stat().st_size, "sha256": file_sha256(newest / rel)}
        (newest / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError) as info:
            make_trainer(_config(tiny_example, run, "trainer.total_steps=3", f"trainer.resume={newest}")).fit()
        assert not marker.exists(), f"{rel}: unpickling ran code ({info.value})"
        # one line naming the checkpoint and the file, not torch's "Weights only load failed..." essay
        message = str(info.value)
        assert message.startswith(f"{newest}") and rel in message and "\n" not in message, message
        assert "Weights only load failed" not in message and len(message) < 400, message
        (newest / rel).write_bytes(pristine)
        (newest / MANIFEST).write_text(pristine_manifest)


TORN = '{"step": 3, "reward/mean": 0.'  # a record killed mid-write


def _tear(run: Path) -> None:
    for name in ("metrics.jsonl", "trace.jsonl"):
        with open(run / name, "a") as f:
            f.write(TORN)


@pytest.fixture(scope="module")
def resumed_over_torn_logs(two_checkpoints, tiny_example, tmp_path_factory) -> tuple[Path, str]:
    """`rlcore train` to step 3 (traced) on a copy of the 2-step run whose logs end in a torn
    line: the run folder and what the command printed to stderr. Read by the torn-line test and
    the resume-announcement test (one resumed run for both)."""
    from rlcore.cli import main

    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(two_checkpoints, run)
    _tear(run)
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(run)), *QUICK,
            "trainer.total_steps=3", "trainer.trace=true"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    assert code == 0, err.getvalue()
    return run, err.getvalue()


def test_torn_last_lines_are_dropped_on_resume(two_checkpoints, resumed_over_torn_logs, tmp_path, caplog):
    torn = tmp_path / "torn"  # the logs alone, torn as the resumed run's were before it started
    torn.mkdir()
    for name in ("metrics.jsonl", "trace.jsonl"):
        if (two_checkpoints / name).exists():
            shutil.copy(two_checkpoints / name, torn)
    _tear(torn)
    for name in ("metrics.jsonl", "trace.jsonl"):
        assert [r["step"] for r in read_jsonl(torn / name)] == ([1, 2] if name == "metrics.jsonl" else [])
    assert "torn last line" in caplog.text
    run, _ = resumed_over_torn_logs
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(run / "trace.jsonl")] == [3]

    damaged = tmp_path / "mid.jsonl"  # damage anywhere but the last line is an error naming the line
    damaged.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"mid.jsonl:2: not a JSON record"):
        read_jsonl(damaged)


def test_a_fresh_start_leaves_no_rows_of_an_earlier_attempt(two_checkpoints, tiny_example, tmp_path):
    """The earlier attempt is the module's 2-step run (rows 1 and 2, its checkpoints left there)."""
    run = _copy(two_checkpoints, tmp_path)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    extra = ("trainer.total_steps=1", "trainer.val_before_train=true", "trainer.resume=disable")
    make_trainer(_config(tiny_example, run, *extra)).fit()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1]
    truncate_jsonl(run / "metrics.jsonl", -1)
    assert read_jsonl(run / "metrics.jsonl") == []


def test_a_non_finite_learning_rate_is_refused_at_load(tiny_example, tmp_path):
    for value in ("inf", ".nan", "-1"):
        with pytest.raises(ConfigError, match=r"actor\.optim\.lr"):
            _config(tiny_example, tmp_path / "run", f"actor.optim.lr={value}")


def test_an_exploding_update_stops_the_run_and_keeps_the_healthy_checkpoint(two_checkpoints, tiny_example, tmp_path):
    """lr=1e30 leaves a finite loss but weights of ~1e30: the health guard stops the run at that
    step, before it is saved, and keep_last never prunes the healthy checkpoints (the module's
    2-step run's: a save with keep_last=1 would have left one)."""
    run = _copy(two_checkpoints, tmp_path)
    # a resumed run keeps its optimizer's learning rate: a fresh run from step 2's weights explodes
    healthy = run / "checkpoints" / "step_00000002"
    with pytest.raises(TrainingStopped, match=r"actor/param_norm_growth|non-finite"):
        make_trainer(_config(tiny_example, run, "trainer.total_steps=3", "trainer.keep_last=1", "trainer.save_every=1",
                             "trainer.resume=disable", f"model.path={healthy / 'actor'}", "actor.optim.lr=1e30",
                             "actor.optim.warmup_steps=0")).fit()
    manager = CheckpointManager(run / "checkpoints")
    assert [step_of(p) for p in manager.complete()] == [1, 2]
    assert step_of(manager.latest()) == 2


def test_rlcore_train_applies_the_health_settings(tiny_example, tmp_path, capsys):
    """`health:` is honoured by a plain `rlcore train`, not only by the pipeline: an entropy floor
    no policy can meet stops the run at step 1 with a clear message and exit code 3."""
    from rlcore.cli import main

    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(tmp_path / "run")),
            *QUICK, "trainer.total_steps=2", "health.min_entropy=50"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "entropy collapse at step 1" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints" / "step_00000001").exists()
    assert main([*args[:-1], "health.enabled=false"]) == 0


def _forge(checkpoint: Path, rel: str, content: bytes) -> None:
    """Replace a file of a checkpoint and rewrite its manifest to match (an attacker with write access)."""
    (checkpoint / rel).write_bytes(content)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][rel] = {"size": len(content), "sha256": file_sha256(checkpoint / rel)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _forged_trainer_state(checkpoint: Path) -> bytes:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state.pop("train_loader")
    return json.dumps(state).encode()


def _forged_weights(checkpoint: Path) -> bytes:
    """The actor's weights with one tensor of another shape, saved as a valid safetensors file."""
    from safetensors.torch import load_file, save
    weights = load_file(checkpoint / "actor" / "model.safetensors")
    name = next(n for n in sorted(weights) if weights[n].dim() == 2)
    weights[name] = weights[name][:-1].clone()
    return save(weights, metadata={"format": "pt"})


@pytest.mark.parametrize("forged", ["trainer state of another shape", "weights of another shape"])
def test_a_forged_checkpoint_is_refused_in_one_line_and_auto_resume_falls_back(two_checkpoints, tiny_example, tmp_path,
                                                                               forged, capsys):
    """A checkpoint whose manifest was rewritten to match forged content verifies, but cannot be
    restored: refused in one line naming the folder and file (not `KeyError: 'train_loader'` or a
    raw `size mismatch for ...`); `trainer.resume: auto` falls back to the older intact one."""
    run = _copy(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step_00000002"
    rel, content = (("trainer_state.json", _forged_trainer_state(newest)) if forged.startswith("trainer")
                    else ("actor/model.safetensors", _forged_weights(newest)))
    _forge(newest, rel, content)
    with pytest.raises(CheckpointError) as info:
        make_trainer(_config(tiny_example, run, "trainer.total_steps=3", f"trainer.resume={newest}")).fit()
    message = str(info.value)
    assert message.startswith(str(newest)) and f"file {rel}" in message and "\n" not in message, message
    assert ("lacks 'train_loader'" if forged.startswith("trainer") else "does not fit this run's model: tensor") in message, message
    capsys.readouterr()
    history = make_trainer(_config(tiny_example, run, "trainer.total_steps=3", "trainer.save_every=1")).fit()
    assert len(history) == 2 and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]  # from step 1
    err = capsys.readouterr().err
    assert f"resumed from checkpoint step 1 ({run / 'checkpoints' / 'step_00000001'}, trainer.resume=auto)" in err


def test_a_resumed_run_says_which_step_it_continued_from_and_where(resumed_over_torn_logs):
    """`rlcore train` on a run folder with checkpoints: the console says the step and the folder."""
    run, err = resumed_over_torn_logs
    line = f"resumed from checkpoint step 2 ({run / 'checkpoints' / 'step_00000002'}, trainer.resume=auto)"
    assert err.count(f"rlcore: {line}") == 1
