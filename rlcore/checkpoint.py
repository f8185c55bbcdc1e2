"""Atomic, verifiable checkpoints.

A checkpoint is a folder `step_00000042/` holding HF-format model folders (safetensors that
`AutoModelForCausalLM.from_pretrained` loads as is) plus `trainer_state.pt` (optimizer,
scheduler, KL controller, RNG states, data-loader position). It is written under a temporary
name, closed with a `COMPLETE.json` manifest (every file with its size), and only then renamed,
so a run killed mid-save never leaves a folder that `latest()` would pick up; a folder whose
files no longer match the manifest (truncated, deleted) is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

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


def _file_table(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run directory."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def save(self, step: int, write: Callable[[Path], None], extra: dict[str, Any] | None = None) -> Path:
        """`write(folder)` fills a fresh folder; it becomes visible only once complete."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step_{step:08d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write(tmp)
        manifest = {"step": step, "created": time.time(), "files": _file_table(tmp), **(extra or {})}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
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

    def verify(self, path: Path) -> dict[str, Any]:
        """Return the manifest, or raise CheckpointError naming the missing or damaged file."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable {MANIFEST}: {err}") from None
        for rel, size in manifest.get("files", {}).items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{path}: missing file {rel}")
            if f.stat().st_size != size:
                raise CheckpointError(f"{path}: file {rel} has {f.stat().st_size} bytes, manifest says {size}")
        return manifest

    def latest(self) -> Path | None:
        """Newest checkpoint that verifies; damaged ones are skipped with a warning."""
        for path in reversed(self.complete()):
            try:
                self.verify(path)
                return path
            except CheckpointError as err:
                log.warning("skipping damaged checkpoint: %s", err)
        return None

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
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
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, folder / "trainer_state.pt")


def load_trainer_state(folder: Path) -> dict[str, Any]:
    path = folder / "trainer_state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise CheckpointError(f"{path}: cannot load trainer state: {err}") from None
