"""The loop run by each reward worker process (kept free of torch so workers start fast).

A worker is a fresh interpreter started by the driver (see `manager.py`), given two inherited
file descriptors: a socket carrying pickled messages, and a 16-byte shared file holding
[index of the running call or -1, its start time] so the driver can tell which call overran its
timeout without a message per call.

Driver -> worker: ("init", spec, sys_path) once, then ("score", chunk_id, rows) | ("stop",).
Worker -> driver: ("ready", pid) | ("load_error", message) | ("partial" | "done", chunk_id, results).
A row is (index, data_source, solution_str, ground_truth, extra_info); a result is
(index, True, (score, extras)) or (index, False, (message, traceback_text)).

A tool worker (`rlcore.rewards.tools`) is the same loop with ("init_tools", {name: spec}, sys_path,
limits) instead: rows are (index, tool name, arguments) and a result is (index, True, (text,
truncated)) or (index, False, (message, traceback_text)). `limits["memory_mb"]` caps the address
space a call may add to the loaded worker (RLIMIT_AS), so a call that allocates too much fails with
MemoryError (or kills only its worker) instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Any

from .registry import RewardFn, load_function, load_reward_fn, normalize_result

# Results are sent when a chunk ends, or earlier once this much time passed since the last send:
# cheap calls cost one message per chunk, and a later hang loses at most this much finished work.
FLUSH_S = 0.05

Row = tuple[int, str, str, Any, Any]
ToolRow = tuple[int, str, Any]


def score_row(fn: RewardFn, row: Row) -> tuple[int, bool, Any]:
    index, data_source, solution_str, ground_truth, extra_info = row
    try:
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
        return index, True, normalize_result(result)
    except (Exception, SystemExit) as e:  # sys.exit() in user code is an error, not an exit
        return index, False, (f"{type(e).__name__}: {e}", traceback.format_exc())


def tool_text(result: Any) -> str:
    """What a tool returned, as the text the model reads: a string as is, JSON values as JSON;
    anything else is an error (a tool must answer in text the chat template can render), and so
    is text that is not valid Unicode (lone surrogates, as `surrogateescape` decoding of bytes that
    are not UTF-8 leaves them: no tokenizer can encode it)."""
    if isinstance(result, str):
        text = str.__str__(result)  # a plain str, also of a str subclass (whose pickle the driver could not load)
    elif result is None or isinstance(result, (bool, int, float, list, dict)):
        try:
            text = json.dumps(result, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise TypeError(f"tool returned {type(result).__name__} that is not JSON: {type(e).__name__}: {e}") from None
    elif isinstance(result, (bytes, bytearray, memoryview)):
        raise TypeError(f"tool returned {type(result).__name__}, expected text: decode it first "
                        "(e.g. .decode('utf-8', errors='replace'))")
    else:
        raise TypeError(f"tool returned {type(result).__name__}, expected a string or a JSON value")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"tool returned text that is not valid Unicode ({e.reason}: {text[e.start]!r} at "
                         f"character {e.start}); decode bytes with errors='replace'") from None
    return text


def error_message(e: BaseException, max_chars: int) -> str:
    """"<Type>: message" of a failed call, at most `max_chars` characters, whatever the exception's
    `str` does (raise, run long, hold lone surrogates)."""
    try:
        detail = str(e)
    except Exception:  # noqa: BLE001 - a user exception whose __str__ fails
        detail = ""
    message = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
    return message[:max_chars].encode("utf-8", "replace").decode("utf-8")


def run_tool(tools: dict[str, Any], row: ToolRow, max_chars: int) -> tuple[int, bool, Any]:
    """Call one tool with its JSON arguments as keywords; (text, truncated) or the error."""
    index, name, arguments = row
    try:
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        text = tool_text(tools[name](**arguments))
        return index, True, (text[:max_chars], len(text) > max_chars)
    except (Exception, SystemExit) as e:  # MemoryError included: the call, not the worker, failed
        try:
            trace = traceback.format_exc()[-20_000:]
        except Exception:  # noqa: BLE001 - formatting a hostile exception
            trace = ""
        return index, False, (error_message(e, max_chars), trace.encode("utf-8", "replace").decode("utf-8"))


def _limit_memory(memory_mb: float | None) -> None:
    """Cap this process's address space at what it uses now plus `memory_mb` (RLIMIT_AS): the
    budget of one call on top of the loaded tools, since a worker runs one call at a time."""
    if memory_mb is None:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * page
    except OSError:
        used = 0
    limit = used + int(memory_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


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
    init = conn.recv()
    kind, spec, sys_path = init[:3]
    sys.path[:] = sys_path  # import user modules exactly as the driver would
    try:
        if kind == "init_tools":
            limits = init[3]
            tools = {name: load_function(s, "tool") for name, s in spec.items()}
            max_chars = int(limits["max_chars"])
            _limit_memory(limits.get("memory_mb"))

            def handle(row: Any) -> tuple[int, bool, Any]:
                return run_tool(tools, row, max_chars)
        else:
            fn = load_reward_fn(spec)

            def handle(row: Any) -> tuple[int, bool, Any]:
                return score_row(fn, row)
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
            results.append(handle(row))
            now = time.monotonic()
            if now - last_send >= FLUSH_S:
                conn.send(("partial", chunk_id, results))
                results, last_send = [], now
        progress[0] = -1.0
        conn.send(("done", chunk_id, results))
