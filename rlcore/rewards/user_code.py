"""User code (reward functions, tools, interactions) loaded first in a child interpreter, never
in the process that asked.

A user's file runs arbitrary code when it is imported: it may call `sys.exit(0)`, loop forever,
or kill its interpreter. Imported in the `rlcore` command's own process, the first ended the
command with status 0 and nothing trained, the second hung it without a word. So every spec is
loaded here in a fresh interpreter (`describe`), which reports per spec that it loaded (and, for a
tool, its schema) or why not; the caller gets one `SpecError` line naming the spec and the file.
A spec whose load does not finish within `load_timeout_s()` (the bound the reward and tool pools
give their workers to load the same files) is killed and named; the bound counts from the start
of each spec's load (after the child's own start-up), so neither a loaded machine's slow start
nor a slow earlier import eats a later one's time.

What the child found is kept per spec (and per file version) for the life of the process, so
preflight, the data loaders and the tool pool of one run pay for one child between them. Tool
schemas come from the child too: a tool file is only ever imported by the pool's sandboxed
workers. An interaction, which runs in the rollout worker, is still imported there after its
check here passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .registry import SpecError, is_path_spec, load_function

TIMEOUT_VAR = "RLCORE_USER_CODE_TIMEOUT_S"
DEFAULT_LOAD_TIMEOUT_S = 120.0  # RewardScorer's and ToolPool's start_timeout_s
STARTUP_TIMEOUT_S = 300.0  # the child's own start (Python, rlcore, transformers' schema reader), before any user code
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv[1]); "
              "from rlcore.rewards.user_code import child_main; child_main(sys.argv[2], sys.argv[3])")

# (spec, what, schemas, sys.path, file stamp) -> ("ok", schema or None) | ("error", message)
_FOUND: dict[tuple[Any, ...], tuple[str, Any]] = {}


def load_timeout_s() -> float:
    """The bound on loading one spec: `RLCORE_USER_CODE_TIMEOUT_S`, default 120 s."""
    raw = os.environ.get(TIMEOUT_VAR)
    if raw is None:
        return DEFAULT_LOAD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise SpecError(f"{TIMEOUT_VAR}={raw!r}: expected a positive number of seconds")
    return value


def _file_stamp(spec: str) -> tuple[int, int] | None:
    where = spec.rpartition(":")[0]
    if not is_path_spec(where):
        return None
    try:
        st = os.stat(where)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _key(spec: str, what: str, schemas: bool) -> tuple[Any, ...]:
    return spec, what, schemas, tuple(sys.path), _file_stamp(spec)


def describe(specs: list[str], what: str, error: type[SpecError], *, schemas: bool) -> list[dict[str, Any] | None]:
    """Load each spec in a child interpreter; per spec its tool schema (`schemas`) or None.
    Raises `error` for the first spec that cannot be loaded, naming it (see the module doc)."""
    todo = [s for s in dict.fromkeys(specs) if _key(s, what, schemas) not in _FOUND]
    if todo:
        for spec, outcome in zip(todo, _run_child(todo, what, schemas), strict=True):
            if outcome is not None:
                _FOUND[_key(spec, what, schemas)] = outcome
    out = []
    for spec in specs:
        kind, value = _FOUND.get(_key(spec, what, schemas), ("error", f"{what} spec {spec!r}: not loaded"))
        if kind == "error":
            raise error(value)
        out.append(value)
    return out


def _run_child(specs: list[str], what: str, schemas: bool) -> list[tuple[str, Any] | None]:
    """Outcome per spec from one child interpreter; None for specs after one that hung or killed
    the child (not tried)."""
    timeout = load_timeout_s()
    with tempfile.TemporaryDirectory(prefix="rlcore-user-code-") as tmp:
        request, events, output = Path(tmp, "request.json"), Path(tmp, "events.jsonl"), Path(tmp, "output.txt")
        request.write_text(json.dumps({"specs": specs, "what": what, "schemas": schemas, "sys_path": sys.path}))
        events.touch()
        with open(output, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, _PACKAGE_ROOT, str(request), str(events)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        outcomes: dict[int, tuple[str, Any]] = {}
        loading, since = -1, time.monotonic()  # -1: the child's own start-up, bounded by STARTUP_TIMEOUT_S
        try:
            while True:
                finished = proc.poll() is not None
                for line in events.read_text(encoding="utf-8").split("\n")[:-1]:  # whole lines only
                    event = json.loads(line)
                    if "loading" in event and event["loading"] > loading:
                        loading, since = event["loading"], time.monotonic()
                    elif "done" in event:
                        outcomes[event["done"]] = (event["kind"], event["value"])
                if finished or len(outcomes) == len(specs):
                    break
                if loading < 0 and time.monotonic() - since > STARTUP_TIMEOUT_S:
                    raise SpecError(f"{what} spec {specs[0]!r}: the interpreter that loads it did not start within "
                                    f"{STARTUP_TIMEOUT_S:g} s")
                if loading >= 0 and time.monotonic() - since > timeout:
                    outcomes[loading] = ("error", f"{what} spec {specs[loading]!r}: loading it did not finish within "
                                                  f"{timeout:g} s (an import that never returns?; {TIMEOUT_VAR})")
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        loading = max(loading, 0)
        if len(outcomes) < len(specs) and loading not in outcomes:  # the child died while loading this one
            said = [ln for ln in output.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            last = f"; its last output: {said[-1].strip()[:300]}" if said else ""
            outcomes[loading] = ("error", f"{what} spec {specs[loading]!r}: loading it ended its interpreter "
                                          f"(exit status {proc.returncode}){last}")
    return [outcomes.get(i) for i in range(len(specs))]


def child_main(request_path: str, events_path: str) -> None:
    """The child: load each spec, appending {"loading": i} and {"done": i, "kind", "value"} lines."""
    import threading

    from ._worker import _exit_when_orphaned

    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    sys.path[:] = request["sys_path"]
    what, schemas = request["what"], request["schemas"]
    if schemas:  # imported before the clock starts: the bound is on the user's code, not on ours
        from transformers.utils.chat_template_utils import get_json_schema  # noqa: F401
    with open(events_path, "a", encoding="utf-8") as events:
        def say(event: dict[str, Any]) -> None:
            events.write(json.dumps(event) + "\n")
            events.flush()

        for i, spec in enumerate(request["specs"]):
            say({"loading": i})
            try:
                fn = load_function(spec, what)
                value = None
                if schemas:
                    from .tool_schema import tool_schema

                    value = tool_schema(fn, spec)
                    json.dumps(value)  # what the parent reads back must be JSON
                say({"done": i, "kind": "ok", "value": value})
            except SpecError as err:
                say({"done": i, "kind": "error", "value": str(err)})
            except BaseException as err:  # noqa: BLE001 - sys.exit() or anything else user code raises
                say({"done": i, "kind": "error", "value": f"{what} spec {spec!r}: {type(err).__name__}: {err}"[:2000]})
    os._exit(0)  # no atexit hooks or threads of user code may keep the child alive


__all__ = ["DEFAULT_LOAD_TIMEOUT_S", "STARTUP_TIMEOUT_S", "TIMEOUT_VAR", "child_main", "describe", "load_timeout_s"]
