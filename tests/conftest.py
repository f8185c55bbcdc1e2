"""Shared fixtures. `tiny_example` builds (or reuses from the cache) the built-in example once per
test session; tests that use it should be marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_example():
    """The built-in tiny example for seed 0, from `$RLCORE_CACHE` (built there on first use)."""
    from rlcore.example import build_tiny_example

    return build_tiny_example(seed=0)


def prefect_env(home: Path) -> dict[str, str]:
    """Environment variables that keep a test's Prefect entirely under `home`. Prefect 3.7 derives
    its result storage and memo-store paths from the default home, not from PREFECT_HOME, so
    those are set too (otherwise tests write into ~/.prefect)."""
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(home / "memo_store.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def train_on_ray(config: Path, overrides: list[str], timeout: float = 600) -> None:
    """`rlcore train CONFIG OVERRIDES` in a subprocess on a fresh local Ray (its own short temp
    dir: Ray's socket paths must fit 107 bytes; no token auth); fails the test with its stderr."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    args = [sys.executable, "-m", "rlcore.cli", "train", str(config), *overrides,
            f"ray.temp_dir={ray_tmp}", "ray.call_timeout_s=300", "ray.init_timeout_s=300"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), RAY_AUTH_MODE="disabled")
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
