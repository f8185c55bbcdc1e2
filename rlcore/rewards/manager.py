"""Score many responses in parallel worker processes, with a timeout on every call.

A reward function is user code: it may raise, hang, or crash its interpreter. None of that may
stop training, so calls run in a pool of persistent worker *processes* (a hung call can only be
stopped by killing its process; a thread cannot be killed). Each failed call scores
`error_score` and is counted; the pool replaces any worker it loses and carries on.

How the pool works, and why:
- Workers are fresh interpreters (`python -c ...`, spawn semantics: safe when the driver has
  torch loaded and threads running, unlike fork), started once and reused across `score` calls.
  They are started with `subprocess`, not `multiprocessing.Process`, because multiprocessing's
  spawn and forkserver re-run the driver's `__main__` module in every worker: that demands an
  `if __name__ == "__main__"` guard of every script and costs the driver's imports (torch, ray)
  on each worker (re)start. Each worker loads the function itself from its spec string (with the
  driver's sys.path), so user functions need not be picklable. (POSIX only: inherited fds.)
- Items go to workers in chunks (few pipe messages for cheap rule-based scorers). A worker
  writes the index and start time of the call it is running into shared memory, so the driver
  knows which call overran without a message per item; it then kills that worker, scores the
  item `error_score`, and gives the rest of the chunk to the others. Calls that finished in
  the last `_worker.FLUSH_S` before a hang are re-run (deterministic scorers make this safe).
- `num_workers=0` scores serially in this process: for debugging (pdb works, tracebacks are
  local). There is NO timeout enforcement in that mode: a hanging function hangs the caller.
"""

from __future__ import annotations

import logging
import math
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import TYPE_CHECKING, Any

import numpy as np

from rlcore.redact import redact_text

from ._worker import Row, score_row
from .registry import load_reward_fn, resolve_spec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The largest finite float32: scores (and extras) beyond it would become inf in the [N] arrays.
FLOAT32_MAX = float(np.finfo(np.float32).max)

# Rows lost with a worker that died while it was not inside any call (so no call can be blamed)
# are re-run at most this often, so that nothing can make the pool loop forever.
MAX_ATTEMPTS = 3


class RewardWorkerError(RuntimeError):
    """The pool itself is broken (a worker cannot start or load the function): not one bad call."""


@dataclass
class ScoreItem:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict | None = None


@dataclass
class ScoreResult:
    scores: np.ndarray  # [N] float32, error_score where the call failed
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # [N] float32 each, NaN where absent
    n_errors: int = 0  # calls that raised, returned a bad value, or crashed their worker
    n_timeouts: int = 0  # calls killed after timeout_s
    first_error: str | None = None  # first failure in input order: "Type: message (item i, ...)"
    failed: np.ndarray | None = None  # [N] bool, True where error_score was used
    n_clipped: int = 0  # scores beyond the scorer's clip, clipped to it

    @property
    def n_failed(self) -> int:
        return self.n_errors + self.n_timeouts


# The directory holding the `rlcore` package, so a worker finds it before it gets our sys.path.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from rlcore.rewards._worker import main; main(int(sys.argv[2]), int(sys.argv[3]))"
)


class _Worker:
    """Driver-side handle of one worker process; `init` is its first message (`_worker.py`)."""

    def __init__(self, init: tuple[Any, ...]) -> None:
        self.conn, child_conn = mp.Pipe(duplex=True)
        with tempfile.TemporaryFile() as shared:  # the mapping outlives the file object
            shared.truncate(16)
            self._mmap = mmap.mmap(shared.fileno(), 16)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, _PACKAGE_ROOT, str(child_conn.fileno()), str(shared.fileno())],
                pass_fds=(child_conn.fileno(), shared.fileno()),
                stdin=subprocess.DEVNULL,
            )
        child_conn.close()  # so the driver sees EOF when the worker dies
        self.progress = memoryview(self._mmap).cast("d")  # [index of the running call or -1, start]
        self.progress[0] = -1.0
        self.conn.send(init)
        self.started_at = time.monotonic()
        self.ready = False
        self.chunk_id = 0
        self.rows: dict[int, Row] | None = None  # rows sent and not yet answered

    @property
    def busy(self) -> bool:
        return self.rows is not None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered yet
            pass

    def release(self) -> None:
        self.conn.close()
        self.progress.release()
        self._mmap.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask politely, then kill whatever has not exited (also run at interpreter exit)."""
    for w in workers:
        try:
            w.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
        w.release()
    workers.clear()


class RewardScorer:
    """Parallel, fault-tolerant scoring with the function named by `fn_spec`.

    fn_spec: None for the built-in scorers chosen by data_source, else "pkg.module:function" or
    "path/to/file.py:function" (verl's signature). The spec is also loaded here once, so a bad
    one raises ValueError at construction, naming the spec.
    num_workers: worker processes; 0 scores serially in this process (no timeouts, see module doc).
    timeout_s: limit per call (one item). error_score: the score of a failed call.
    clip: a score beyond ±clip is clipped to it and counted (`ScoreResult.n_clipped`); None clips
    only at float32's range, so a returned 1e300 can never become inf.
    chunk_size: items per message to a worker; default: about 4 chunks per worker per call.
    """

    def __init__(
        self,
        fn_spec: str | None = None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        error_score: float = 0.0,
        clip: float | None = None,
        *,
        chunk_size: int | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if clip is not None and not 0 < clip <= FLOAT32_MAX:
            raise ValueError(f"clip must be > 0 and within float32's range, got {clip}")
        self.clip = float(clip) if clip is not None else FLOAT32_MAX
        if abs(error_score) > self.clip:
            raise ValueError(f"error_score={error_score:g} lies beyond clip={self.clip:g}")
        self.fn_spec = resolve_spec(fn_spec)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.error_score = float(error_score)
        self.chunk_size = chunk_size
        self.start_timeout_s = float(start_timeout_s)
        self._fn = load_reward_fn(self.fn_spec)  # fail fast on a bad spec; used when num_workers=0
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._workers: list[_Worker] = []
        self._workers.extend(self._start_worker() for _ in range(num_workers))
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ----------------------------------------------------------------- lifecycle
    label = "reward"  # how errors name this pool's workers and what they load

    def _start_worker(self) -> _Worker:
        return _Worker(("init", self.fn_spec, list(sys.path)))

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- scoring
    def score(self, items: Sequence[ScoreItem]) -> ScoreResult:
        """Scores in input order; never raises for a failing call (see ScoreResult counters)."""
        if self._closed:
            raise RuntimeError("RewardScorer.score called after close()")
        if self._broken is not None:
            raise RewardWorkerError(self._broken)
        rows: list[Row] = [
            (i, it.data_source, it.solution_str, it.ground_truth, it.extra_info) for i, it in enumerate(items)
        ]
        outcomes: dict[int, tuple[str, Any]] = {}
        with self._lock:
            if self.num_workers == 0:
                for row in rows:
                    index, ok, payload = score_row(self._fn, row)
                    outcomes[index] = ("ok", payload) if ok else ("error", payload)
            elif rows:
                run = PoolRun(self, outcomes, self.chunk_size or max(1, math.ceil(len(rows) / (4 * len(self._workers)))))
                run.add(rows)
                run.run()
        return self._collect(items, [outcomes.get(i) for i in range(len(rows))])

    def _collect(self, items: Sequence[ScoreItem], outcomes: list[tuple[str, Any] | None]) -> ScoreResult:
        n = len(outcomes)
        scores = np.full(n, self.error_score, dtype=np.float32)
        failed = np.zeros(n, dtype=bool)
        extra: dict[str, np.ndarray] = {}
        n_errors = n_timeouts = n_clipped = 0
        first_error: str | None = None
        first_tb: str | None = None
        first_clipped: str | None = None
        for i, outcome in enumerate(outcomes):
            assert outcome is not None, f"item {i} was never scored"
            kind, payload = outcome
            if kind == "ok":
                score, extras = payload
                if abs(score) > self.clip:
                    n_clipped += 1
                    if first_clipped is None:
                        first_clipped = f"{score:g} (item {i}, data_source={items[i].data_source!r})"
                    score = math.copysign(self.clip, score)
                scores[i] = score
                for key, value in extras.items():
                    if key not in extra:
                        extra[key] = np.full(n, np.nan, dtype=np.float32)
                    extra[key][i] = min(max(value, -FLOAT32_MAX), FLOAT32_MAX)  # a metric: kept finite, not counted
                continue
            failed[i] = True
            if kind == "timeout":
                n_timeouts += 1
                message, tb = payload, None
            else:
                n_errors += 1
                message, tb = payload
            if first_error is None:
                # user code's text: redacted as it enters (it becomes a metric, a log line, an error)
                first_error = redact_text(f"{message} (item {i}, data_source={items[i].data_source!r})")
                first_tb = tb
        if first_error is not None:
            log.warning(
                "reward: %d of %d calls failed (%d errors, %d timeouts) and scored %s; first: %s%s",
                n_errors + n_timeouts, n, n_errors, n_timeouts, self.error_score, first_error,
                f"\n{first_tb}" if first_tb else "",
            )
        if first_clipped is not None:
            log.warning("reward: %d of %d scores beyond ±%g were clipped to it (reward.clip); first: %s",
                        n_clipped, n, self.clip, first_clipped)
        return ScoreResult(scores, extra, n_errors, n_timeouts, first_error, failed, n_clipped)


class PoolRun:
    """Calls over a pool's worker processes: dispatch chunks, collect, police timeouts.

    `pool` is a `RewardScorer` or a `rlcore.rewards.tools.ToolPool` (its `_workers`, `timeout_s`,
    `start_timeout_s`, `label`, `fn_spec`, `_start_worker()`). Rows may be added at any time
    (`add`), and `step` does one round of dispatch / wait (at most `max_wait` s) / police, so a
    caller can interleave other work (the agent loop generates while tools run); `run` steps
    until every row added has an outcome. Outcomes land in `outcomes` by row index.
    """

    def __init__(self, pool: Any, outcomes: dict[int, tuple[str, Any]], chunk_size: int) -> None:
        self.s = pool
        self.workers = pool._workers
        self.outcomes = outcomes
        self.open: set[int] = set()  # rows added and without an outcome yet
        self.attempts: dict[int, int] = {}
        self.chunk_size = chunk_size
        self.queue: deque[list[Any]] = deque()

    @property
    def remaining(self) -> int:
        return len(self.open)

    def add(self, rows: list[Any]) -> None:
        self.open.update(row[0] for row in rows)
        size = self.chunk_size
        self.queue.extend(rows[i:i + size] for i in range(0, len(rows), size))

    def run(self) -> None:
        while self.open:
            self.step()

    def step(self, max_wait: float = 1.0) -> None:
        """One round; a broken pool raises `RewardWorkerError`, an interruption leaves no worker
        holding stale work."""
        try:
            self._dispatch()
            self._wait_and_collect(max_wait)
            self._police()
        except RewardWorkerError as e:
            self.s._broken = str(e)
            _stop_workers(self.workers)
            raise
        except BaseException:
            # Interrupted (Ctrl-C) or a systemic failure: leave no worker holding stale work.
            for slot, w in enumerate(self.workers):
                if w.busy:
                    self._kill(w)
                    self.workers[slot] = self.s._start_worker()
            raise

    # ---------------------------------------------------------------- outcomes
    def _record(self, index: int, outcome: tuple[str, Any]) -> None:
        if index in self.open:
            self.open.discard(index)
            self.outcomes[index] = outcome

    def _requeue(self, rows: list[Row], why: str, culprit_known: bool) -> None:
        """Hand back rows a lost worker had not answered. When the failing call is known, the
        others are innocent (never started, or finished unreported) and go back as they are."""
        again = []
        for row in rows:
            n = self.attempts.get(row[0], 0) + (0 if culprit_known else 1)
            self.attempts[row[0]] = n
            if n >= MAX_ATTEMPTS:
                self._record(row[0], ("error", (f"WorkerDied: {why} (item lost {n} times)", None)))
            else:
                again.append(row)
        if again:
            self.queue.appendleft(again)

    # ---------------------------------------------------------------- the loop
    def _dispatch(self) -> None:
        for w in self.workers:
            if not self.queue:
                return
            if w.ready and not w.busy:
                if not w.alive():  # died while idle: replace it, don't hand it work
                    self._on_death(w)
                    continue
                chunk = self.queue.popleft()
                w.chunk_id += 1
                w.rows = {row[0]: row for row in chunk}
                # The driver starts the clock: the worker overwrites it per row from here on.
                w.progress[1] = time.monotonic()
                w.progress[0] = float(chunk[0][0])
                try:
                    w.conn.send(("score", w.chunk_id, chunk))
                except (OSError, ValueError):
                    w.progress[0] = -1.0  # it never started a row
                    self._on_death(w)

    def _deadline(self, w: _Worker) -> float:
        if not w.ready:
            return w.started_at + self.s.start_timeout_s
        if w.busy and w.progress[0] >= 0:
            return w.progress[1] + self.s.timeout_s
        return time.monotonic() + 1.0  # chunk finished; its "done" message is on the way

    def _wait_and_collect(self, max_wait: float = 1.0) -> None:
        pending = [w for w in self.workers if w.busy or not w.ready]
        if not pending:
            return
        timeout = min(self._deadline(w) for w in pending) - time.monotonic()
        # At most 1 s of sleep: a worker can also die without closing its socket (a grandchild
        # holding it), which only polling notices.
        fired = set(mp_wait([w.conn for w in pending], timeout=min(max(timeout, 0.0), 1.0, max_wait)))
        for w in pending:
            if w.conn in fired or not w.alive():
                self._drain(w)

    def _drain(self, w: _Worker) -> None:
        """Handle every message the worker has sent; a closed pipe means the worker died."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            self._on_death(w)
            return
        if not w.alive():
            self._on_death(w)

    def _handle(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            raise RewardWorkerError(f"{self.s.label} worker could not load {self.s.fn_spec!r}: {msg[1]}")
        elif kind in ("partial", "done"):
            _, chunk_id, results = msg
            if chunk_id != w.chunk_id or w.rows is None:
                return
            for index, ok, payload in results:
                w.rows.pop(index, None)
                self._record(index, ("ok", payload) if ok else ("error", payload))
            if kind == "done":
                w.rows = None

    def _kill(self, w: _Worker) -> None:
        w.kill()
        try:  # results it sent before dying are still in the pipe
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.release()

    def _replace(self, w: _Worker) -> None:
        self.workers[self.workers.index(w)] = self.s._start_worker()

    def _on_death(self, w: _Worker) -> None:
        try:
            w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # EOF, yet alive: it closed its socket; treat as dead
            pass
        code = w.proc.returncode
        if not w.ready:
            raise RewardWorkerError(
                f"{self.s.label} worker exited with code {code} while starting (loading {self.s.fn_spec!r})"
            )
        culprit = int(w.progress[0])  # the call it was running when it died, or -1
        self._kill(w)  # drains what it sent (answered rows leave w.rows); closes the pipe
        rows = w.rows or {}
        why = f"{self.s.label} worker process exited with code {code}"
        known = culprit in rows
        if known:
            rows.pop(culprit)
            self._record(culprit, ("error", (f"WorkerDied: {why} during this call", None)))
        w.rows = None
        self._requeue(list(rows.values()), why, culprit_known=known)
        self._replace(w)

    def _police(self) -> None:
        now = time.monotonic()
        for w in list(self.workers):
            if not w.ready:
                if now > w.started_at + self.s.start_timeout_s:
                    raise RewardWorkerError(
                        f"{self.s.label} worker did not start within {self.s.start_timeout_s:.0f} s (loading {self.s.fn_spec!r})"
                    )
                continue
            if not w.busy:
                continue
            index = int(w.progress[0])
            started = w.progress[1]
            if index < 0 or now - started <= self.s.timeout_s or index not in (w.rows or {}):
                continue
            self._kill(w)
            rows = w.rows or {}
            if index in rows:  # not answered even in the drained messages
                rows.pop(index)
                self._record(index, ("timeout", f"TimeoutError: {self.s.label} call exceeded {self.s.timeout_s:g} s"))
            w.rows = None
            self._requeue(list(rows.values()), f"{self.s.label} worker was killed after a timeout", culprit_known=True)
            self._replace(w)


def scores_to_token_rewards(scores: np.ndarray | Sequence[float] | torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N,R] float32 rewards: each sample's score at its last response token, zeros elsewhere.

    The last token is the last position where the mask is set (responses are right-padded; an
    agent trajectory's mask has holes where tool outputs are, and its last model token is what the
    reward lands on); a sample with an empty response gets no reward anywhere.
    """
    import torch

    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [N, R], got shape {tuple(response_mask.shape)}")
    scores_t = torch.as_tensor(np.asarray(scores, dtype=np.float32) if not isinstance(scores, torch.Tensor) else scores)
    scores_t = scores_t.to(device=response_mask.device, dtype=torch.float32).reshape(-1)
    n = response_mask.shape[0]
    if scores_t.numel() != n:
        raise ValueError(f"scores has {scores_t.numel()} entries but response_mask has {n} rows")
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    set_ = response_mask != 0
    positions = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    last = torch.where(set_, positions, -1).max(dim=-1).values
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    rewards[rows, last[rows]] = scores_t[rows]
    return rewards
