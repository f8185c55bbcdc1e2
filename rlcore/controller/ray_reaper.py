"""What is left of a local Ray is stopped when the process that started it dies, however it died.

Ray ties the processes a driver starts for its local cluster (GCS, raylet, dashboard, monitors)
to the driver: the kernel kills them when it dies (`PR_SET_PDEATHSIG`). The raylet's own children
are not tied that way: when their raylet is killed, the dashboard agent and the runtime-env agent
first try, for 60 s, to tell the GCS (killed with it) before they exit (Ray 2.60,
`ray._private.process_watcher.report_raylet_error_logs`). A SIGKILLed or OOM-killed `rlcore
train` left them running a minute or more.

`ensure_ray` starts this watcher after it started a local Ray, with the ids of the processes Ray
started (the roots), as a plain script (`python -I ray_reaper.py DRIVER ROOT...`: standard library
only, neither rlcore nor Ray imported). Every `POLL_S` it notes the roots' descendants (process id
and start time, from /proc). When the driver is gone (the pipe on its stdin reads end-of-file, or
its parent changed), it SIGKILLs every noted process still running (the same id and start time:
never a process that reused an id) and exits. When the roots end while the driver lives
(`ray.shutdown()`), it exits without touching anything. It ignores SIGINT, SIGTERM and SIGHUP,
which reach it with its driver's process group (Ctrl-C, a closed terminal, `kill -- -PGID`): that
is when it is needed. Linux only, like the kernel fate-sharing it completes. A process Ray starts
less than a look (`POLL_S`) before the driver dies is not yet noted and can be missed.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections import defaultdict

POLL_S = 1.0

Table = dict[int, tuple[int, int]]  # pid -> (parent pid, start time in clock ticks)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a running process; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def processes() -> Table:
    """Every running process of this machine (that /proc shows)."""
    table: Table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _stat(int(name))
            if found is not None:
                table[int(name)] = found
    return table


def children_of(pid: int, table: Table | None = None) -> set[int]:
    """The direct children of `pid`."""
    table = processes() if table is None else table
    return {child for child, (parent, _) in table.items() if parent == pid}


def descendants(roots: dict[int, int], table: Table) -> dict[int, int]:
    """`roots` (pid -> start time) still running, and all their descendants, as pid -> start time."""
    by_parent: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in table.items():
        by_parent[parent].append(pid)
    found = {pid: start for pid, start in roots.items() if table.get(pid, (0, -1))[1] == start}
    todo = list(found)
    while todo:
        for child in by_parent.get(todo.pop(), ()):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def kill_noted(noted: dict[int, int]) -> int:
    """SIGKILL every noted process that still runs with its noted start time; how many."""
    killed = 0
    for pid, start in noted.items():
        found = _stat(pid)
        if found is not None and found[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:  # gone meanwhile
                pass
    return killed


def driver_gone(driver: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the driver's pipe; whether the driver is gone."""
    ready, _, _ = select.select([0], [], [], timeout_s)
    if ready and not os.read(0, 4096):
        return True
    return os.getppid() != driver


def watch(driver: int, roots: list[int]) -> int:
    """The watcher's loop (see the module docstring); returns how many processes it killed."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    table = processes()
    started = {pid: table[pid][1] for pid in roots if pid in table}
    noted = descendants(started, table)
    while not driver_gone(driver, POLL_S):
        table = processes()
        now = descendants(started, table)
        if not any(pid in now for pid in started):
            return 0  # Ray was shut down by its driver: nothing to guard
        noted = {**{pid: start for pid, start in noted.items() if table.get(pid, (0, -1))[1] == start}, **now}
    return kill_noted(noted)


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]])
