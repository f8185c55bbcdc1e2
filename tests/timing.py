"""The one factor every wall-clock bound in the suite scales with.

Waits in the tests are on events or progress where they can be; what is left is a bound on a
machine being slow (a subprocess's timeout, a server's start, a request, pytest-timeout's
per-test limit). A loaded or slower machine sets `RLCORE_TEST_TIME_FACTOR` (default 1; e.g. 3
runs every such bound three times as long) instead of editing the numbers. Timeouts that rlcore
itself is tested to enforce (a tool call cut at `timeout_s`, a notification to a dead port) are
behaviour, not bounds, and do not scale.
"""

from __future__ import annotations

import os


def time_factor() -> float:
    """`RLCORE_TEST_TIME_FACTOR`, a positive number; refused naming the variable otherwise."""
    raw = os.environ.get("RLCORE_TEST_TIME_FACTOR", "1")
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not factor > 0 or factor == float("inf"):
        raise ValueError(f"RLCORE_TEST_TIME_FACTOR={raw!r}: expected a positive number of times (default 1)")
    return factor


def scaled(seconds: float) -> float:
    """`seconds` times the suite's time factor."""
    return seconds * time_factor()
