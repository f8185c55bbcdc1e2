"""scripts/cpu_time.py, the wrapper `./dev test` and `./dev fast` run pytest under: the CPU
seconds it prints include a daemon that detached from the command (as `ray start` leaves its
raylet and GCS behind), which `time`'s accounting misses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_time.py"
LINE = re.compile(r"\[rlcore\] demo: ([\d.]+) CPU s .* in ([\d.]+) s wall, whole process tree")

# Starts a grandchild in a session of its own that burns `seconds` of CPU, and exits at once
# without waiting for it (the grandchild is orphaned), then exits with status 3.
DETACH = """
import subprocess, sys
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < {seconds}: pass"
subprocess.Popen([sys.executable, "-c", burn], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
sys.exit(3)
"""


def run_wrapped(seconds: float, grace: float) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--label", "demo", "--grace", str(grace), "--",
                           sys.executable, "-c", DETACH.format(seconds=seconds)],
                          capture_output=True, text=True, timeout=scaled(600))
    return done.returncode, done.stderr


def test_a_detached_grandchild_is_counted_and_the_commands_status_kept():
    rc, err = run_wrapped(seconds=1.5, grace=600)
    assert rc == 3, err
    found = LINE.search(err)
    assert found, err
    # The command itself uses ~0.1 CPU s: the rest is the orphan, reaped by the wrapper.
    assert float(found.group(1)) >= 1.4, err
    assert "still running" not in err


def test_an_orphan_still_running_after_the_grace_is_named_and_counted_so_far():
    rc, err = run_wrapped(seconds=30.0, grace=1.0)
    left = re.search(r"still running after demo: pid (\d+) python", err)
    if left:  # the wrapper leaves it running: stop it here
        os.kill(int(left.group(1)), signal.SIGKILL)
    assert rc == 3, err
    assert LINE.search(err), err
    assert left, err
    # Its CPU seconds so far (read from /proc), a positive share of the total.
    spent = re.search(r"of which ([\d.]+) s by 1 processes still running", err)
    assert spent and float(spent.group(1)) > 0, err
