"""Atomic checkpoints, verified before they are trusted.

A checkpoint is a folder `step_00000042/` holding HF-format model folders (safetensors that
`AutoModelForCausalLM.from_pretrained` loads as is), optimizer/scheduler state, and
`trainer_state.json` (step, data-loader position, KL controller, RNG states: JSON, so loading a
checkpoint never unpickles anything). It is written under a temporary name, closed with a
`COMPLETE.json` manifest (every file with its size and SHA-256, written last, atomically), and only
then renamed, so a run killed mid-save never leaves a folder that `latest()` would pick up.

Before a resume, `verify` re-hashes every file and checks that every floating-point tensor in the
safetensors files is finite; `latest()` falls back past a damaged checkpoint to the newest intact
one, naming the bad file, and stops with every reason when none is intact. Pruning (`keep_last`)
never removes the newest checkpoint marked healthy (saved after a step that passed the health
checks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and file."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_table(root: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def check_finite_weights(path: Path) -> None:
    """Raise CheckpointError naming the first tensor of a safetensors file that is not finite."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"{path}: tensor {name} has non-finite values")
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any read failure means the file is unusable
        raise CheckpointError(f"{path}: unreadable safetensors file: {err}") from None


def weights_only_reason(err: BaseException) -> str:
    """The one line of torch's "Weights only load failed..." text that says what was refused."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    line = found.group(1) if found else (text.strip().splitlines() or [type(err).__name__])[0]
    return line.split(" Please ")[0].strip().rstrip(".")[:300]


def check_torch_file(folder: Path, rel: str) -> None:
    """A `.pt` file of a checkpoint is a `torch.save` archive whose pickle holds plain data only
    (tensors, numbers, strings, containers): read with `weights_only=True` (memory-mapped, so only
    its pickle is read), never run. Raises CheckpointError naming the folder and file."""
    import pickle
    import warnings
    import zipfile

    path = folder / rel
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{folder}: file {rel} is not a torch.save archive (refused without unpickling it)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{folder}: file {rel} holds more than plain data and was refused without running it "
                              f"({weights_only_reason(err)})") from None
    except Exception as err:  # noqa: BLE001 - any other failure: the file is unusable
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"{folder}: file {rel} is not a readable torch file ({type(err).__name__}: {first})") from None


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run directory. `state_keys`: what a
    checkpoint's trainer state must hold for this run to resume from it (its data loader, KL
    controller, guards...): one without them is damaged, for this run."""

    def __init__(self, root: str | Path, keep_last: int = 2, state_keys: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.state_keys = tuple(state_keys)

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def save(self, step: int, write: Callable[[Path], None], extra: dict[str, Any] | None = None,
             healthy: bool = True) -> Path:
        """`write(folder)` fills a fresh folder; it becomes visible only once complete. `healthy`:
        the step passed the run's health checks (pruning keeps the newest healthy checkpoint)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step_{step:08d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write(tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        manifest = {"step": step, "created": time.time(), "healthy": healthy, "files": _file_table(tmp), **(extra or {})}
        part = tmp / f".{MANIFEST}.part"
        with open(part, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / MANIFEST)  # written last: the folder is whole
        final = self.path_for(step)
        if final.exists():  # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary and unmarked folders are ignored)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def verify(self, path: Path, weights: bool = True) -> dict[str, Any]:
        """Return the manifest, or raise CheckpointError naming the checkpoint and the missing,
        changed (size or SHA-256) or non-finite file. `weights`: also check that the safetensors
        weights are finite."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: unreadable {MANIFEST}: {err}") from None
        for rel, expected in files.items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{path}: missing file {rel}")
            size = expected["size"] if isinstance(expected, dict) else expected  # older manifests: sizes only
            if f.stat().st_size != size:
                raise CheckpointError(f"{path}: file {rel} has {f.stat().st_size} bytes, manifest says {size}")
            if isinstance(expected, dict) and file_sha256(f) != expected["sha256"]:
                raise CheckpointError(f"{path}: file {rel} does not match its SHA-256 in {MANIFEST} (changed or corrupted)")
        for rel in files:
            if rel.endswith(".pt"):
                check_torch_file(path, rel)
        if TRAINER_STATE in files:
            state = load_trainer_state(path)
            missing = [key for key in ("step", "rng", *self.state_keys) if key not in state]
            if missing:
                raise CheckpointError(f"{path}: file {TRAINER_STATE} lacks {', '.join(map(repr, missing))} (not this "
                                      "run's trainer state: written by another recipe, or edited)")
        if weights:
            for rel in files:
                if rel.endswith(".safetensors"):
                    check_finite_weights(path / rel)
        return manifest

    def intact(self) -> Iterator[Path]:
        """Checkpoints that verify, newest first; damaged ones are skipped with a warning naming the
        bad file. Once every one has been offered: CheckpointError if some exist but none is intact."""
        problems = []
        offered = False
        for path in reversed(self.complete()):
            try:
                self.verify(path)
            except CheckpointError as err:
                log.warning("skipping damaged checkpoint: %s", err)
                problems.append(str(err))
                continue
            if problems:
                log.warning("falling back to the intact checkpoint %s", path)
            offered = True
            yield path
        if problems and not offered:
            raise CheckpointError(f"no intact checkpoint in {self.root}: " + "; ".join(problems))

    def latest(self) -> Path | None:
        """Newest checkpoint that verifies (`intact`); None when there is no checkpoint;
        CheckpointError when there are some but none is intact."""
        return next(self.intact(), None)

    def newest_healthy(self) -> Path | None:
        """The newest complete checkpoint marked healthy in its manifest."""
        for path in reversed(self.complete()):
            try:
                if json.loads((path / MANIFEST).read_text()).get("healthy", True):
                    return path
            except (OSError, ValueError):
                continue
        return None

    def _prune(self) -> None:
        done = self.complete()
        keep = self.newest_healthy()
        for old in done[: max(0, len(done) - self.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint folder (expected step_XXXXXXXX)")
    return int(m.group(1))


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (and CUDA) generator states, as JSON-safe lists."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


TRAINER_STATE = "trainer_state.json"


def save_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    """The controller's state as JSON (no pickle: loading a checkpoint can never run code)."""
    with open(folder / TRAINER_STATE, "w") as f:
        json.dump(state, f, allow_nan=True)


def load_trainer_state(folder: Path) -> dict[str, Any]:
    path = folder / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot load trainer state: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: trainer state is not a JSON object")
    return state
