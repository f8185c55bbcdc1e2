"""The loop run by each reward worker process (kept free of torch so workers start fast).

A worker is a fresh interpreter started by the driver (see `manager.py`), given two inherited
file descriptors: a socket carrying pickled messages, and a 16-byte shared file holding
[index of the running call or -1, its start time] so the driver can tell which call overran its
timeout without a message per call.

Driver -> worker: ("init", spec, sys_path) once, then ("score", chunk_id, rows) | ("stop",).
Worker -> driver: ("ready", pid) | ("load_error", message) | ("partial" | "done", chunk_id, results).
A row is (index, data_source, solution_str, ground_truth, extra_info); a result is
(index, True, (score, extras)) or (index, False, (message, traceback_text)).
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from .registry import RewardFn, load_reward_fn, normalize_result

# Results are sent when a chunk ends, or earlier once this much time passed since the last send:
# cheap calls cost one message per chunk, and a later hang loses at most this much finished work.
FLUSH_S = 0.05

Row = tuple[int, str, str, Any, Any]


def score_row(fn: RewardFn, row: Row) -> tuple[int, bool, Any]:
    index, data_source, solution_str, ground_truth, extra_info = row
    try:
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
        return index, True, normalize_result(result)
    except (Exception, SystemExit) as e:  # sys.exit() in user code is an error, not an exit
        return index, False, (f"{type(e).__name__}: {e}", traceback.format_exc())


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker stuck in a call never reads the EOF its dead driver leaves; this thread notices."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(sock_fd: int, progress_fd: int) -> None:
    from multiprocessing.connection import Connection

    # Ctrl-C goes to the whole process group; the driver decides, workers must not die mid-call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    conn = Connection(sock_fd)
    progress = memoryview(mmap.mmap(progress_fd, 16)).cast("d")
    _, spec, sys_path = conn.recv()
    sys.path[:] = sys_path  # import user modules exactly as the driver would
    try:
        fn = load_reward_fn(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if msg[0] == "stop":
            return
        _, chunk_id, rows = msg
        results: list[tuple[int, bool, Any]] = []
        last_send = time.monotonic()
        for row in rows:
            progress[1] = time.monotonic()  # start time first, then index: see the driver
            progress[0] = row[0]
            results.append(score_row(fn, row))
            now = time.monotonic()
            if now - last_send >= FLUSH_S:
                conn.send(("partial", chunk_id, results))
                results, last_send = [], now
        progress[0] = -1.0
        conn.send(("done", chunk_id, results))
