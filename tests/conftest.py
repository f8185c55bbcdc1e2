"""Shared fixtures. `tiny_example` builds (or reuses from the cache) the built-in example once per
test session; tests that use it should be marked slow."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry


def _prefect_http() -> requests.Session:
    """HTTP for tests that talk to a Prefect server's REST API directly. The server answers 503
    when its SQLite database is busy (another writer held the lock; the request rolled back), and
    Prefect's own client retries those: so does this session, for every method, with backoff."""
    retry = Retry(total=8, backoff_factor=0.25, status_forcelist=(503,), allowed_methods=None, raise_on_status=False)
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return session


PREFECT_HTTP = _prefect_http()


def stop_process_group(proc: subprocess.Popen | None) -> None:
    """SIGINT, then SIGKILL, to the process group a test started (`start_new_session=True`)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def wait_for(what: str, fn: Callable[[], Any], timeout: float, procs: Sequence[subprocess.Popen] = (),
             interval: float = 1.0) -> Any:
    """Poll `fn` until it returns something truthy (a failed HTTP request counts as not yet); fail
    when one of `procs` exits first, or after `timeout` seconds, naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a helper process exited with {p.returncode}")
        try:
            value = fn()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="session")
def tiny_example():
    """The built-in tiny example for seed 0, from `$RLCORE_CACHE` (built there on first use)."""
    from rlcore.example import build_tiny_example

    return build_tiny_example(seed=0)


@pytest.fixture(scope="session")
def own_model(tmp_path_factory):
    """A user's own Qwen2 model, BPE tokenizer with ChatML, two end tokens, verl-schema data and a
    reward file (tests/own_model.py), built once per session (about a second, no downloads)."""
    from own_model import build_own_model  # tests/ is on sys.path (pytest rootdir conftest)

    return build_own_model(tmp_path_factory.mktemp("own_model"))


def prefect_env(home: Path) -> dict[str, str]:
    """Environment variables that keep a test's Prefect entirely under `home`. Prefect 3.7 derives
    its result storage and memo-store paths from the default home, not from PREFECT_HOME, so
    those are set too (otherwise tests write into ~/.prefect)."""
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(home / "memo_store.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def train_on_ray(config: Path, overrides: list[str], timeout: float = 600, command: str = "train") -> None:
    """`rlcore train CONFIG OVERRIDES` (or `rlcore sft`: `command`) in a subprocess on a fresh local
    Ray (its own short temp dir: Ray's socket paths must fit 107 bytes; no token auth); fails the
    test with its stderr."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    args = [sys.executable, "-m", "rlcore.cli", command, str(config), *overrides,
            f"ray.temp_dir={ray_tmp}", "ray.call_timeout_s=300", "ray.init_timeout_s=300"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), RAY_AUTH_MODE="disabled")
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]


@contextlib.contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[tuple[str, dict[str, str], Path]]:
    """`prefect server start` on a free 127.0.0.1 port with its home under `home` (and `env` on
    top): yields the API URL, the environment a client of it needs, and the server's log file.
    Stopped with SIGINT, then SIGKILL, on exit."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home.mkdir(parents=True, exist_ok=True)
    server_env = dict(os.environ, **prefect_env(home), PREFECT_UI_ENABLED="false", **env)
    server_env.pop("PREFECT_API_URL", None)
    log_path = home / "server.log"
    api = f"http://127.0.0.1:{port}/api"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"the Prefect server exited with {proc.returncode}: see {log_path}")
                try:
                    if requests.get(f"{api}/health", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"the Prefect server did not answer within 90 s: see {log_path}")
                time.sleep(0.5)
            yield api, dict(server_env, PREFECT_API_URL=api), log_path
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


@pytest.fixture
def prefect_api(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A Prefect server for one test (`prefect_server` under tmp_path): its API URL and the
    environment a client of it needs."""
    with prefect_server(tmp_path / "prefect") as (api, env, _log):
        yield api, env
