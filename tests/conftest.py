"""Shared fixtures. `tiny_example` builds (or reuses from the cache) the built-in example once per
test session; tests that use it should be marked slow."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_example():
    """The built-in tiny example for seed 0, from `$RLCORE_CACHE` (built there on first use)."""
    from rlcore.example import build_tiny_example

    return build_tiny_example(seed=0)
