"""Tools for agent rollouts: Python functions with an OpenAI-style JSON schema, called in the same
sandboxed worker processes as reward functions, asynchronously.

A tool is named in a config by `module:function` or `path/to/file.py:function`. Its schema is the
function's `tool_schema` attribute when it has one, else what transformers' `get_json_schema`
reads from its signature and Google-style docstring (what chat templates render `tools=` from).

Why the reward pool (`rlcore.rewards.manager`): a tool runs model-written arguments through user
code, so it must be allowed to raise, hang, allocate without bound or crash its interpreter without
stopping the rollout. Each call runs in a worker process with a timeout (the worker is killed and
replaced) and a memory limit (RLIMIT_AS over what the loaded tools use); every failure becomes an
error text the model reads in its tool turn, counted by the caller. Calls are submitted and
collected (`submit`, `poll`), never waited for one by one, so the agent loop generates for the
samples that are ready while other samples' tools run.
"""

from __future__ import annotations

import json
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .manager import PoolRun, RewardWorkerError, _stop_workers, _Worker
from .registry import resolve_spec
from .tool_schema import ToolSpecError, checked_schema, tool_schema
from .user_code import describe


@dataclass(frozen=True)
class Tool:
    name: str
    spec: str  # resolved: a file path made absolute
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


def load_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """name -> `Tool` for each spec, in order; raises `ToolSpecError` naming the spec. The tool
    files are loaded and their schemas read in a child interpreter (`user_code.describe`): only the
    pool's sandboxed workers ever import them."""
    resolved = [str(resolve_spec(raw)) for raw in specs]
    described = describe(resolved, "tool", ToolSpecError, schemas=True)
    tools: dict[str, Tool] = {}
    for raw, spec, found in zip(specs, resolved, described, strict=True):
        schema = checked_schema(found, raw)
        name = schema["function"]["name"]
        if name in tools:
            raise ToolSpecError(f"tool spec {raw!r}: a second tool named {name!r} (first: {tools[name].spec})")
        tools[name] = Tool(name, spec, schema)
    return tools


SCHEMA_FILE_SUFFIXES = (".json",)


def tool_schemas(specs: Sequence[str]) -> list[dict[str, Any]]:
    """The OpenAI-style schemas a chat template renders (`tools=`) for `specs`, in order: a tool
    function's (`module:function`, `file.py:function`; see `tool_schema`), or a `.json` file's (one
    schema or a list of them: tools that only need describing, as in SFT data). The one place RL's
    prompts and SFT's rows get their tools from. `ToolSpecError` naming the spec; two tools of
    one name are refused."""
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    functions = [raw for raw in specs if not str(raw).lower().endswith(SCHEMA_FILE_SUFFIXES)]
    if functions:
        load_tools(functions)  # all function specs loaded by one child (its findings kept per spec)
    for raw in specs:
        if str(raw).lower().endswith(SCHEMA_FILE_SUFFIXES):
            path = Path(raw)
            try:
                loaded = json.loads(path.read_text())
            except OSError as e:
                raise ToolSpecError(f"tool spec {raw!r}: cannot read the schema file ({e.strerror or e})") from None
            except ValueError as e:
                raise ToolSpecError(f"tool spec {raw!r}: the schema file is not JSON ({e})") from None
            except RecursionError:
                raise ToolSpecError(f"tool spec {raw!r}: the schema file is nested too deeply to be a tool schema") from None
            schemas = [checked_schema(x, raw) for x in (loaded if isinstance(loaded, list) else [loaded])]
        else:
            schemas = [t.schema for t in load_tools([raw]).values()]
        for schema in schemas:
            name = schema["function"]["name"]
            if name in seen:
                raise ToolSpecError(f"tool spec {raw!r}: a second tool named {name!r} (first: {seen[name]})")
            seen[name] = str(raw)
            out.append(schema)
    return out


@dataclass(frozen=True)
class ToolOutcome:
    """One finished call: `text` is what the model reads in its tool turn (the result, or the error)."""

    call_id: int
    name: str
    text: str
    ok: bool
    error: str | None  # "<Type>: message" of a failed call (raised, bad result, timeout, worker died)
    timed_out: bool
    truncated: bool  # the result was longer than max_chars and was cut
    latency_s: float  # from submit to outcome


def error_text(error: str) -> str:
    """The tool turn a failed call gets."""
    return f"Error: {error}"


class ToolPool:
    """Sandboxed, asynchronous tool calls: `submit(call_id, name, arguments)`, then `poll`.

    num_workers: worker processes (calls run in parallel across them, one at a time in each).
    timeout_s: limit per call. memory_mb: address space a call may add (None: no limit).
    max_chars: longer results are cut to this many characters (`ToolOutcome.truncated`).
    """

    label = "tool"

    def __init__(self, specs: Sequence[str], num_workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: float | None = 1024.0, max_chars: int = 2000, *, start_timeout_s: float = 120.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (tools always run sandboxed), got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tools = load_tools(specs)
        self.fn_spec = ", ".join(t.spec for t in self.tools.values())  # what error messages name
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._limits = {"memory_mb": memory_mb, "max_chars": int(max_chars)}
        self._closed = False
        self._broken: str | None = None
        self._workers: list[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._outcomes: dict[int, tuple[str, Any]] = {}
        self._run = PoolRun(self, self._outcomes, chunk_size=1)
        self._submitted: dict[int, tuple[str, float]] = {}  # call id -> (tool name, submit time)
        self._early: list[ToolOutcome] = []  # calls answered without a worker (unknown tool)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema, for a chat template's `tools=`."""
        return [t.schema for t in self.tools.values()]

    def _start_worker(self) -> _Worker:
        specs = {name: t.spec for name, t in self.tools.items()}
        return _Worker(("init_tools", specs, list(sys.path), self._limits))

    @property
    def pending(self) -> int:
        return len(self._submitted) + len(self._early)

    def submit(self, call_id: int, name: str, arguments: Any) -> None:
        """Queue a call (`call_id` unique over the pool's life); its outcome comes from `poll`."""
        if self._closed:
            raise RuntimeError("ToolPool.submit called after close()")
        if self._broken is not None:
            raise RewardWorkerError(self._broken)
        if name not in self.tools:
            known = ", ".join(self.tools)
            error = f"UnknownTool: no tool named {name!r} (tools: {known})"
            self._early.append(ToolOutcome(call_id, name, error_text(error), False, error, False, False, 0.0))
            return
        self._submitted[call_id] = (name, time.monotonic())
        self._run.add([(call_id, name, arguments)])

    def poll(self, timeout: float = 0.0) -> list[ToolOutcome]:
        """Outcomes of finished calls, waiting up to `timeout` s for at least one (0: don't wait)."""
        deadline = time.monotonic() + max(0.0, timeout)
        done, self._early = self._early, []
        while True:
            if self._submitted:
                self._run.step(max_wait=max(0.0, deadline - time.monotonic()))
            done += self._collect()
            if done or not self._submitted or time.monotonic() >= deadline:
                return done

    def _collect(self) -> list[ToolOutcome]:
        out = []
        now = time.monotonic()
        for call_id in [c for c in self._submitted if c in self._outcomes]:
            name, start = self._submitted.pop(call_id)
            kind, payload = self._outcomes.pop(call_id)
            if kind == "ok":
                text, truncated = payload if isinstance(payload, tuple) and len(payload) == 2 else (None, False)
                if type(text) is str:
                    out.append(ToolOutcome(call_id, name, text, True, None, False, bool(truncated), now - start))
                    continue
                kind, payload = "error", (f"InvalidToolResult: the worker sent {type(text).__name__}, not text", None)
            error = payload if kind == "timeout" else payload[0]
            error = str(error)[: self._limits["max_chars"]]
            out.append(ToolOutcome(call_id, name, error_text(error), False, error, kind == "timeout", False, now - start))
        return out

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Tool", "ToolOutcome", "ToolPool", "ToolSpecError", "error_text", "load_tools", "tool_schema", "tool_schemas"]
