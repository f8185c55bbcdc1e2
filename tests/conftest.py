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
