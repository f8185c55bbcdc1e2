"""The suite's wall-clock bounds (tests/timing.py): they scale with RLCORE_TEST_TIME_FACTOR, and
`wait_for` with a progress measure waits as long as the thing waited for keeps advancing."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled, time_factor

TESTS = Path(__file__).resolve().parent


def test_the_factor_scales_bounds_and_a_bad_one_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("RLCORE_TEST_TIME_FACTOR", "2.5")
    assert scaled(40) == 100
    for bad in ("0", "-1", "x", "inf", "nan"):
        monkeypatch.setenv("RLCORE_TEST_TIME_FACTOR", bad)
        with pytest.raises(ValueError, match="RLCORE_TEST_TIME_FACTOR"):
            time_factor()


def test_wait_for_keeps_waiting_while_there_is_progress_and_not_without(monkeypatch):
    monkeypatch.setenv("RLCORE_TEST_TIME_FACTOR", "1")
    ticks = itertools.count()
    start = time.monotonic()
    # Done after ~0.6 s, well past the 0.2 s bound, but advancing at every poll.
    assert wait_for("a slow stage", lambda: time.monotonic() - start > 0.6, 0.2, interval=0.02,
                    progress=lambda: next(ticks)) is True
    with pytest.raises(AssertionError, match="with no progress waiting for a stuck stage"):
        wait_for("a stuck stage", lambda: False, 0.2, interval=0.02, progress=lambda: 0)


@pytest.mark.slow  # a pytest process of its own; the factor itself: the tests above
def test_pytest_timeouts_per_test_limit_scales_with_the_factor(tmp_path):
    """A test marked timeout(200) that sleeps 5 s fails at 200 x 0.005 = 1 s."""
    (tmp_path / "test_sleepy.py").write_text(
        "import time, pytest\n@pytest.mark.timeout(200)\ndef test_sleeps():\n    time.sleep(5)\n")
    env = dict(os.environ, RLCORE_TEST_TIME_FACTOR="0.005", PYTHONPATH=str(TESTS))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_sleepy.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 1, done.stdout[-3000:]
    assert "Timeout (>1.0s) from pytest-timeout" in done.stdout, done.stdout[-3000:]
