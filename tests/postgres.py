"""Throwaway PostgreSQL servers for tests and the soak benchmark: a PostgreSQL cluster from the
distribution's own binaries (Debian's `postgresql` package: /usr/lib/postgresql/<version>/bin), and
a Prefect server and an MLflow tracking server whose stores are databases in it.

PostgreSQL refuses to run as root: started by root, the cluster runs as the `postgres` system user
in a temporary folder that user owns (a test's tmp_path is under root's 0700 folder, out of its
reach). It listens on 127.0.0.1 on a free port and puts its unix socket in that folder; `trust`
authentication for the one role, `rlcore`. fsync is off: a throwaway cluster needs no durability,
and the machine's disk is shared.

Standard library, requests and the project's tests/ helpers only; run as the tests' `postgres`
fixture (module scope) or from benchmarks/soak_postgres.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from net import free_port
from timing import scaled

INSTALL_HINT = "install the distribution's package: apt-get install postgresql"
ROLE = "rlcore"
# A database error in a Prefect or MLflow server's log: SQLite's lock (the failure PostgreSQL
# replaces), SQLAlchemy's and the drivers' exception names, PostgreSQL's own refusals.
DB_ERROR = re.compile(r"database is locked|OperationalError|IntegrityError|InterfaceError|DBAPIError|"
                      r"asyncpg\.exceptions|psycopg2\.\w*Error|PendingRollbackError|deadlock detected|"
                      r"too many (?:clients|connections)")
# ... and in PostgreSQL's own log: a statement it refused or a connection it dropped.
PG_ERROR = re.compile(r"\b(?:ERROR|FATAL|PANIC):")
# Refusals a server makes on purpose and recovers from. Prefect's task-run recorder inserts task runs
# from events after an existence check and, when two batches race on one task run, lets PostgreSQL
# refuse the second insert and retries it (prefect/server/services/task_run_recorder.py,
# `record_bulk_task_run_events`); only a retry that fails too loses the event, and that shows in
# Prefect's own log as an IntegrityError ("Duplicate task_run, discarding event"), which DB_ERROR counts.
RECOVERED = re.compile(r'duplicate key value violates unique constraint "pk_task_run"')


def pg_bin_dir() -> Path:
    """The folder of `initdb` and `postgres`: $RLCORE_PG_BIN, else `initdb` on PATH, else the newest
    /usr/lib/postgresql/<version>/bin (Debian keeps them off PATH). Refused naming the package."""
    if env := os.environ.get("RLCORE_PG_BIN"):
        candidates = [Path(env)]
    elif found := shutil.which("initdb"):
        candidates = [Path(found).resolve().parent]  # a link on PATH into the version's folder
    else:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version(p.parent.name), reverse=True)
        candidates = versions
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    where = os.environ.get("RLCORE_PG_BIN") or "PATH and /usr/lib/postgresql/*/bin"
    raise RuntimeError(f"PostgreSQL's initdb and postgres not found in {where}: {INSTALL_HINT}")


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in name.split(".") if p.isdigit())


@dataclasses.dataclass(frozen=True)
class Postgres:
    """A running cluster: where a client connects, and its server log."""

    port: int
    socket_dir: Path
    log: Path

    def url(self, database: str, driver: str) -> str:
        """A SQLAlchemy URL, e.g. `url("prefect", "asyncpg")` for Prefect's server (async) and
        `url("mlflow", "psycopg2")` for MLflow's (sync)."""
        return f"postgresql+{driver}://{ROLE}@127.0.0.1:{self.port}/{database}"


@dataclasses.dataclass(frozen=True)
class RunAs:
    """Who PostgreSQL's programs run as: the `postgres` user when this process is root (PostgreSQL
    refuses root), else this process's own user (all None: Popen changes nothing)."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None

    @staticmethod
    def for_postgres() -> RunAs:
        if os.geteuid() != 0:
            return RunAs()
        try:
            user = pwd.getpwnam("postgres")
        except KeyError as exc:
            raise RuntimeError(f"running as root and there is no `postgres` system user: {INSTALL_HINT}") from exc
        return RunAs(user.pw_uid, user.pw_gid, [])

    def own(self, path: Path) -> None:
        if self.user is not None and self.group is not None:
            os.chown(path, self.user, self.group)


@contextlib.contextmanager
def postgres_cluster(databases: tuple[str, ...] = ("prefect", "mlflow"), log_dir: Path | None = None) -> Iterator[Postgres]:
    """initdb + postgres on 127.0.0.1 (a free port) with `databases` created; everything removed on
    exit. The server's log is copied to `log_dir` (when given) on exit, for a test to read."""
    bin_dir = pg_bin_dir()
    who = RunAs.for_postgres()
    root = Path(tempfile.mkdtemp(prefix="rlcore-pg-", dir="/tmp"))  # short: a unix socket path fits 107 bytes
    who.own(root)
    data, log = root / "data", root / "server.log"
    env = dict(os.environ, LC_ALL="C.UTF-8", TZ="UTC")
    # vLLM's CPU platform puts torch's libgomp (under /root) in LD_PRELOAD of a process that imported
    # it (an earlier test of this xdist worker); the postgres user cannot open it, and ld.so's
    # complaint would be an "ERROR:" line of the server's log
    env.pop("LD_PRELOAD", None)
    proc: subprocess.Popen | None = None
    try:
        done = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", ROLE, "--auth=trust", "-E", "UTF8",
                               "--no-sync", "--no-instructions"], env=env, capture_output=True, text=True,
                              timeout=scaled(120), user=who.user, group=who.group, extra_groups=who.extra_groups)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        port = free_port()
        with open(log, "w") as out:
            who.own(log)
            proc = subprocess.Popen([str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
                                     "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200",
                                     "-c", "log_min_messages=warning"],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    user=who.user, group=who.group, extra_groups=who.extra_groups)
        cluster = Postgres(port, root, log)
        _wait_ready(bin_dir, cluster, proc)
        for name in databases:
            _psql(bin_dir, cluster, f'CREATE DATABASE "{name}"')
        yield cluster
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown
            try:
                proc.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if log_dir is not None and log.is_file():
            log_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, log_dir / "postgres.log")
        shutil.rmtree(root, ignore_errors=True)


def _psql(bin_dir: Path, cluster: Postgres, sql: str, database: str = "postgres") -> str:
    done = subprocess.run([str(bin_dir / "psql"), "-h", str(cluster.socket_dir), "-p", str(cluster.port), "-U", ROLE,
                           "-d", database, "-v", "ON_ERROR_STOP=1", "-Atc", sql],
                          capture_output=True, text=True, timeout=scaled(60))
    if done.returncode != 0:
        raise RuntimeError(f"psql {sql!r}: {done.stderr.strip()}")
    return done.stdout


def _wait_ready(bin_dir: Path, cluster: Postgres, proc: subprocess.Popen) -> None:
    bound = scaled(120)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}: {cluster.log.read_text()[-2000:]}")
        ready = subprocess.run([str(bin_dir / "pg_isready"), "-q", "-h", str(cluster.socket_dir), "-p", str(cluster.port),
                                "-U", ROLE, "-d", "postgres"],
                               timeout=scaled(30))
        if ready.returncode == 0:
            return
        time.sleep(0.3)
    raise RuntimeError(f"postgres did not accept connections within {bound:.0f} s: {cluster.log.read_text()[-2000:]}")


@pytest.fixture(scope="module", name="pg_cluster")  # a test file imports pg_cluster_fixture to use it
def pg_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Postgres]:
    """A PostgreSQL cluster for a test file, with databases `prefect` and `mlflow`. Fails (not
    skips) where the binaries are missing, naming the package to install."""
    missing = None
    try:
        pg_bin_dir()
    except RuntimeError as err:
        missing = str(err)
    if missing:  # outside the except: the one line, not a chained traceback
        pytest.fail(missing, pytrace=False)
    with postgres_cluster(log_dir=tmp_path_factory.mktemp("postgres")) as cluster:
        yield cluster


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path, log: Path) -> Iterator[str]:
    """`mlflow server` on a free 127.0.0.1 port over `backend_store_uri`, artifacts proxied to the
    `artifacts` folder; yields its URL. Its output goes to `log`."""
    port = free_port()
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                 "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts),
                                 "--workers", "1"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"{url}/health", proc, "the MLflow server", log)
        yield url
    finally:
        _stop(proc)


def _wait_http(url: str, proc: subprocess.Popen, what: str, log: Path) -> None:
    bound = scaled(180)  # the server creates its tables first (alembic migrations): ~20 s on a loaded machine
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: see {log}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=scaled(2)).ok:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer within {bound:.0f} s: see {log}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=scaled(20))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def db_errors(log: Path, pattern: re.Pattern[str] = DB_ERROR) -> list[str]:
    """The lines of `log` that name a database error (`DB_ERROR`; `PG_ERROR` for PostgreSQL's log),
    less the refusals a server recovers from by design (`RECOVERED`)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [line for line in text.splitlines() if pattern.search(line) and not RECOVERED.search(line)]


__all__ = ["DB_ERROR", "INSTALL_HINT", "PG_ERROR", "RECOVERED", "Postgres", "db_errors", "mlflow_server", "pg_bin_dir",
           "pg_cluster_fixture", "postgres_cluster"]
