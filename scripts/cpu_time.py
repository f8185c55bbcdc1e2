"""Run a command and print the CPU seconds of its whole process tree, with the wall seconds.

    python scripts/cpu_time.py [--label NAME] -- COMMAND [ARGS...]

Prints one line to stderr when COMMAND ends and exits with COMMAND's status:

    [rlcore] pytest: 1234.5 CPU s (user 1100.2, system 134.3) in 612.0 s wall, whole process tree

Why a wrapper and not `time`: a process's CPU seconds are added to its parent's
`RUSAGE_CHILDREN` only when that parent reaps it, and the suite starts daemons that detach
(`ray start` leaves gcs_server and raylet behind and exits; servers run in sessions of their
own). An orphan is adopted by the nearest ancestor that is a *child subreaper*, else by init,
whose accounting nobody sees. This wrapper makes itself a subreaper (prctl
PR_SET_CHILD_SUBREAPER), so every descendant that outlives its parent becomes its child, and
reaps every child as it exits (promptly, so a test waiting for a detached process to vanish
does not see a zombie). When COMMAND has ended, it waits up to `--grace` seconds for the
orphans still running (Ray shuts down asynchronously); any left after that are named, their
CPU seconds so far read from /proc and counted, and they are left running.

Not counted: children of a process that ignores SIGCHLD (the kernel reaps those without
accounting) -- nothing in the suite does that.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def become_subreaper() -> None:
    """Adopt every orphaned descendant (Linux 3.4+)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_until(main_pid: int) -> int:
    """Reap children as they exit until `main_pid` has; returns its wait status."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == main_pid:
            return status


def reap_orphans(grace: float) -> None:
    """Reap the adopted children still running, waiting at most `grace` seconds for them."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children left
            return
        if pid == 0:
            time.sleep(0.1)


def _stat(pid: str) -> tuple[int, str, float] | None:
    """(parent pid, name, CPU s of the process and its reaped children) from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14-17.
    ticks = sum(int(f) for f in fields[11:15])
    return int(fields[1]), name, ticks / CLOCK_TICKS


def still_running() -> list[tuple[int, str, float]]:
    """Every living descendant of this process: (pid, name, CPU s so far, reaped children included)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(entry)) is not None:
            table[int(entry)] = stat
    found, frontier = [], [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, name, cpu) in table.items():
            if ppid == parent:
                found.append((pid, name, cpu))
                frontier.append(pid)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="command", help="what to call COMMAND in the line printed")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds to wait for orphans still running after COMMAND ends (default 15)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given")

    become_subreaper()
    start = time.monotonic()
    child = subprocess.Popen(command)
    # Ctrl-C reaches the whole foreground group: COMMAND handles it, this wrapper waits for it.
    # A handler, not SIG_IGN, so nothing started later inherits an ignored SIGINT.
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda signum, _: child.send_signal(signum))
    status = reap_until(child.pid)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped above: Popen must not wait again
    reap_orphans(args.grace)
    wall = time.monotonic() - start

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = usage.ru_utime, usage.ru_stime
    left = still_running()
    extra = sum(cpu for _, _, cpu in left)
    # A living process's /proc times cover it and the children it reaped; its living children
    # are entries of their own: the sum counts everything once.
    total = user + system + extra
    tail = f", of which {extra:.1f} s by {len(left)} processes still running" if left else ""
    print(f"[rlcore] {args.label}: {total:.1f} CPU s (user {user:.1f}, system {system:.1f}{tail}) "
          f"in {wall:.1f} s wall, whole process tree", file=sys.stderr)
    for pid, name, cpu in left:
        print(f"[rlcore]   still running after {args.label}: pid {pid} {name} ({cpu:.1f} CPU s)", file=sys.stderr)
    code = child.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
