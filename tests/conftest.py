"""Shared fixtures and helpers. Expensive things are built once and shared:

- `tiny_example` (session): the built-in example for seed 0, built once (or reused from the cache).
- `own_model` (session): a user's own Qwen2 model, BPE tokenizer, data and reward (tests/own_model.py).
- `shared_prefect_server` (shared, see below): one `prefect server start` on 127.0.0.1 (its
  scheduler loop every 5 s); `.api`, `.env` (what a client needs), `.log`, `.start_state`.
- `prefect_api` (per test): that server, emptied of what earlier tests made (deployments, flow
  runs, automations, work pools, flows, blocks, variables, artifacts), and a client environment
  whose Prefect home (result storage, task cache) is the test's own: `api, env = prefect_api`.
  Events cannot be deleted: filter them by the resource or run a test made.
- `ray_local` (shared, see below): the address of one local Ray cluster (`ray start --head` on
  127.0.0.1, 4 logical CPUs, no dashboard, no token auth) outside this process; pass it as
  `ray.address` in a config, or connect this process with `ray_driver`. What a test made on it
  belongs to that test's Ray job and is freed when its driver disconnects.
- `ray_driver` (per test): this process connected to `ray_local` (disconnected after the test).
- `ray_cluster` (module): a 3-node Ray cluster on 127.0.0.1 (tests/ray_cluster.py: the head with
  the job server, two `pool=train` workers) for tests that place roles across nodes, lose a node
  or submit Ray jobs; a test that kills a node adds a replacement.

"Shared" (`SharedService`): started by the first test that asks for it and kept while the test
files that follow use it too; stopped after a file when the next one does not. Left running idle
they cost CPU all the same (measured idle on this machine: a Ray head ~6 CPU s a minute, a Prefect
server ~6): so test files are ordered by what they share (`pytest_collection_modifyitems`: Ray
alone, Ray and Prefect, Prefect alone, other slow files, the fast ones), and each service runs
for one stretch per worker. Prefect's ephemeral server, which a flow run in this process starts
when no API is set, is stopped after each test file the same way.

Tests that must watch a server or a cluster of their own start, die or listen (test_ray_binding)
start their own and say why. Every test that starts Ray, vLLM, a Prefect
server or flow, the pipeline or several torch.distributed processes carries the matching marker
(`ray`, `vllm`, `prefect`, `pipeline`, `distributed`) beside `slow`; tests that use the fixtures
above get the marker automatically (`pytest_collection_modifyitems`). `./dev fast` (`-m "not slow"`) does not even
import a file whose module-level `pytestmark` names `slow` or an area marker (`pytest_ignore_collect`):
each xdist worker would otherwise pay its imports (vLLM, Ray, Prefect, MLflow) for nothing.

`./dev test` runs the suite on two pytest-xdist workers, each file's tests on one worker, files
handed out in the order above (`--dist loadfile --no-loadscope-reorder`; xdist's own reorder,
most tests first, would leave the slow one-test files for last): a shared service runs once per
worker that needs it. (`--dist loadgroup` with `xdist_group` marks groups nothing under pytest
9.2: pytest-xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads.)"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest
import requests
from net import free_port  # tests/ is on sys.path (pytest rootdir conftest)
from requests.adapters import HTTPAdapter
from timing import scaled
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

# Prefect reads its settings once, when first imported in a process: a test that sets this later
# (monkeypatch.setenv) is not seen once another test of the same xdist worker imported Prefect, and
# the ephemeral server's 20 s default then fails a loaded machine. Set before any test imports it.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")


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
             interval: float = 1.0, progress: Callable[[], object] | None = None) -> Any:
    """Poll `fn` until it returns something truthy (a failed HTTP request counts as not yet); fail
    when one of `procs` exits first, or after `timeout` seconds (times the suite's time factor,
    tests/timing.py) naming `what`. With `progress` (e.g. a log file's size), the bound is on
    time without progress: each change of its value starts the `timeout` again, so a slow
    machine that is still advancing is waited for."""
    bound = scaled(timeout)
    last = progress() if progress else None
    deadline = time.monotonic() + bound
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
        if progress is not None and (now := progress()) != last:
            last, deadline = now, time.monotonic() + bound
    still = " with no progress" if progress else ""
    raise AssertionError(f"timed out after {bound:.0f}s{still} waiting for {what}")


def tree_progress(*roots: Path) -> Callable[[], tuple[int, int]]:
    """A `wait_for` progress for a run that writes files: the count and total size of the files
    under `roots` (its logs, metrics, checkpoints), which grow while it advances."""
    def measure() -> tuple[int, int]:
        count = size = 0
        for root in roots:
            for path in root.rglob("*") if root.is_dir() else [root]:
                with contextlib.suppress(OSError):
                    if path.is_file():
                        count, size = count + 1, size + path.stat().st_size
        return count, size
    return measure


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's per-test limit (pyproject's, or a test's `timeout` mark) times the suite's
    time factor (tests/timing.py), then pytest-timeout's own timer."""
    import pytest_timeout

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=scaled(settings.timeout)))


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


def train_on_ray(config: Path, overrides: list[str], timeout: float = 600, address: str | None = None,
                 command: str = "train") -> None:
    """`rlcore train CONFIG OVERRIDES` (or `rlcore sft`: `command`) in a subprocess, as a user runs
    it: on the Ray cluster at `address` (the shared `ray_local`), or on a fresh local Ray of its
    own when None (its own short temp dir: Ray's socket paths must fit 107 bytes); no token auth.
    Fails the test with the command's stderr."""
    import os
    import shutil
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    where = [f"ray.address={address}"] if address else [f"ray.temp_dir={ray_tmp}"]
    args = [sys.executable, "-m", "rlcore.cli", command, str(config), *overrides, *where,
            f"ray.call_timeout_s={scaled(300):.0f}", f"ray.init_timeout_s={scaled(300):.0f}"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), RAY_AUTH_MODE="disabled")
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=scaled(timeout))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def ray_cluster():
    """One multi-node Ray cluster on 127.0.0.1 for a test file (tests/ray_cluster.py): the head
    (dashboard and job server; label pool=gen, resource gen_slot) and two worker nodes labelled
    pool=train, one CPU each. A test that kills a node leaves the cluster as it found it: it adds
    a node with the same labels."""
    from ray_cluster import LocalCluster  # tests/ is on sys.path (pytest rootdir conftest)

    cluster = LocalCluster(head={"num_cpus": 3, "labels": {"pool": "gen"}, "resources": {"gen_slot": 4}},
                           workers=[{"num_cpus": 1, "labels": {"pool": "train"}}] * 2)
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[tuple[str, dict[str, str], Path]]:
    """`prefect server start` on a free 127.0.0.1 port with its home under `home` (and `env` on
    top): yields the API URL, the environment a client of it needs, and the server's log file.
    Stopped with SIGINT, then SIGKILL, on exit."""
    import sys

    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    server_env = dict(os.environ, **prefect_env(home), PREFECT_UI_ENABLED="false", **env)
    server_env.pop("PREFECT_API_URL", None)
    log_path = home / "server.log"
    api = f"http://127.0.0.1:{port}/api"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            bound = scaled(180)  # ~11 s on a quiet machine; much longer on a loaded one
            deadline = time.monotonic() + bound
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"the Prefect server exited with {proc.returncode}: see {log_path}")
                try:
                    if requests.get(f"{api}/health", timeout=scaled(2)).ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"the Prefect server did not answer within {bound:.0f} s: see {log_path}")
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


@dataclasses.dataclass(frozen=True)
class PrefectServer:
    """A running `prefect server start`: its API URL, the environment a client of it needs, its
    log, and what it held when it started (`reset_prefect` keeps that)."""

    api: str
    env: dict[str, str]
    log: Path
    start_state: dict[str, set[str]]


T = TypeVar("T")


class SharedService(Generic[T]):
    """A server or cluster that consecutive test files share (see the module docstring): `get`
    starts it on first use (`start` is a context manager), `stop` ends it; the fixture that hands
    it out is named `fixture`, which is how `pytest_runtest_teardown` tells whether the next
    test file needs it."""

    def __init__(self, fixture: str, start: Callable[[pytest.TempPathFactory], contextlib.AbstractContextManager[T]]):
        self.fixture = fixture
        self._start = start
        self._running: tuple[contextlib.ExitStack, T] | None = None

    def get(self, factory: pytest.TempPathFactory) -> T:
        if self._running is None:
            with contextlib.ExitStack() as stack:
                value = stack.enter_context(self._start(factory))
                self._running = (stack.pop_all(), value)
        return self._running[1]

    def stop(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running[0].close()


# What a test can make on a Prefect server, in an order deletion allows: (collection, the field
# that names a record, the path that deletes it). Deleting an automation through the API also
# drops it from the server's trigger service (clearing the database behind it would not).
_PREFECT_OBJECTS = (
    ("automations", "id", "automations/{}"),
    ("deployments", "id", "deployments/{}"),  # and their scheduled runs
    ("flow_runs", "id", "flow_runs/{}"),
    ("work_pools", "name", "work_pools/{}"),
    ("flows", "id", "flows/{}"),
    ("block_documents", "id", "block_documents/{}"),
    ("variables", "name", "variables/name/{}"),
    ("artifacts", "id", "artifacts/{}"),
)


def _prefect_records(api: str, collection: str) -> list[dict[str, Any]]:
    got = PREFECT_HTTP.post(f"{api}/{collection}/filter", json={"limit": 200}, timeout=scaled(30))
    got.raise_for_status()
    return got.json()


def prefect_keys(api: str) -> dict[str, set[str]]:
    """Every record a test could have made, by collection (see `reset_prefect`)."""
    return {c: {str(r[key]) for r in _prefect_records(api, c)} for c, key, _ in _PREFECT_OBJECTS}


def reset_prefect(api: str, keep: dict[str, set[str]]) -> None:
    """Delete every deployment, flow run, automation, work pool, flow, block document, variable
    and artifact on the server that is not in `keep` (what it held when it started)."""
    for collection, key, path in _PREFECT_OBJECTS:
        while True:
            extra = [str(r[key]) for r in _prefect_records(api, collection) if str(r[key]) not in keep[collection]]
            if not extra:
                break
            for name in extra:
                done = PREFECT_HTTP.delete(f"{api}/{path.format(name)}", timeout=scaled(30))
                assert done.status_code in (200, 204, 404), f"deleting {collection} {name}: {done.status_code} {done.text}"


@contextlib.contextmanager
def _shared_prefect(factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """Its scheduler runs every 5 s (Prefect's default is 60 s), so that cron schedules make runs
    within a test's patience."""
    with prefect_server(factory.mktemp("prefect_server"), PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS="5") as (
            api, env, log):
        yield PrefectServer(api, env, log, prefect_keys(api))


SHARED_PREFECT = SharedService("shared_prefect_server", _shared_prefect)


@pytest.fixture(scope="module")
def shared_prefect_server(tmp_path_factory: pytest.TempPathFactory) -> PrefectServer:
    """The Prefect server consecutive test files share (a start costs ~10 s). Tests reach it
    through `prefect_api`, which clears what earlier tests left."""
    return SHARED_PREFECT.get(tmp_path_factory)


@pytest.fixture
def prefect_api(shared_prefect_server: PrefectServer, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The shared Prefect server as this test's own: emptied of what earlier tests made (and
    emptied again after this one), with a client environment whose Prefect home, result storage
    and task cache are under this test's tmp_path. Yields the API URL and that environment."""
    api = shared_prefect_server.api
    reset_prefect(api, shared_prefect_server.start_state)
    env = dict(shared_prefect_server.env, **prefect_env(tmp_path / "prefect_client"), PREFECT_API_URL=api)
    try:
        yield api, env
    finally:
        reset_prefect(api, shared_prefect_server.start_state)


# ----------------------------------------------------------------------------------------- Ray


def _stop_process_group(pgid: int, grace_s: float = 5) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to every process of group `pgid` (not `ray stop`,
    which would stop every Ray on this shared machine)."""
    import psutil

    def members() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid:
                    found.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        _, alive = psutil.wait_procs(members(), timeout=wait_s)
        if not alive:
            return


def _start_ray_head(temp: str) -> tuple[subprocess.Popen, str]:
    """`ray start --head` (see `ray_local`): the finished `ray start` process, whose id names the
    process group the cluster runs in, and the cluster's address."""
    import sys

    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    with open(Path(temp) / "start.log", "w") as log:
        starter = subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                                    "--num-cpus", "4", "--disable-usage-stats", "--include-dashboard=false",
                                    # ports Ray would otherwise take at fixed defaults (52365, 10001): the other
                                    # pytest-xdist worker's cluster, or a user's, may hold them
                                    "--dashboard-agent-listen-port", str(free_port()),
                                    "--ray-client-server-port", str(free_port()),
                                    "--temp-dir", temp], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        starter.wait(timeout=scaled(300))
    except subprocess.TimeoutExpired:
        pass  # no return code: a failed start
    return starter, f"127.0.0.1:{port}"


@contextlib.contextmanager
def _ray_head(factory: pytest.TempPathFactory) -> Iterator[str]:
    """`ray start --head` on 127.0.0.1 with 4 logical CPUs, no dashboard and no token auth (the
    token file lives in the shared home folder), its files in a short /tmp folder (Ray's socket
    paths must fit 107 bytes). `ray start` leaves its processes in a process group of their own
    outside this process's tree (stopped by that group at the end), as a user's cluster would be.
    Yields its address, "127.0.0.1:PORT".

    Ray gives its raylet a fixed 30 s to register (ray/_private/node.py), which a loaded machine
    can miss: a start that failed is cleaned up and tried again, three times at most."""
    import shutil
    import tempfile

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")  # for every process that connects
    temp = ""
    starter = None
    try:
        for _attempt in range(3):
            temp = tempfile.mkdtemp(prefix="rls", dir="/tmp")
            starter, address = _start_ray_head(temp)
            if starter.returncode == 0:
                break
            _stop_process_group(starter.pid)
            log = (Path(temp) / "start.log").read_text()[-3000:]
            shutil.rmtree(temp, ignore_errors=True)
        else:
            raise AssertionError(f"ray start failed three times ({starter.returncode}); the last said:\n{log}")
        yield address
    finally:
        if starter is not None:
            _stop_process_group(starter.pid)
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


SHARED_RAY = SharedService("ray_local", _ray_head)


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The local Ray cluster consecutive test files share (`_ray_head`): its address."""
    pytest.importorskip("ray")
    return SHARED_RAY.get(tmp_path_factory)


@pytest.fixture
def ray_driver(ray_local: str) -> Iterator[str]:
    """This process connected to the shared Ray (`ray_local`) for one test; yields the
    address. Disconnecting ends the test's Ray job: its actors and placement groups go with it."""
    import gc

    import ray

    from rlcore.controller.ray_cluster import ensure_ray

    assert not ray.is_initialized(), "an earlier test left this process connected to Ray"
    ensure_ray(address=ray_local)
    try:
        yield ray_local
    finally:
        gc.collect()  # free this job's object refs while it is still connected
        ray.shutdown()


# ------------------------------------------------------------------------------------ markers

# Fixtures that start (or reach) something an area marker names.
_FIXTURE_MARKERS = {"shared_prefect_server": "prefect", "prefect_api": "prefect", "ray_local": "ray", "ray_driver": "ray",
                    "ray_cluster": "ray"}
_AREA_MARKERS = ("ray", "prefect", "vllm", "pipeline", "distributed")


def _module_markers(path: Path) -> set[str]:
    """The marker names of a test file's module-level `pytestmark` (`pytest.mark.NAME`, alone or in
    a list), read from its source without importing it."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return set()  # let pytest import it and report what is wrong
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for mark in ast.walk(node.value):
                if isinstance(mark, ast.Attribute) and isinstance(mark.value, ast.Attribute) and mark.value.attr == "mark":
                    names.add(mark.attr)
    return names


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m "not slow"` (`./dev fast`), a test file whose every test is `slow` (its module-level
    `pytestmark` names `slow` or an area marker, which implies it) is not even imported: its imports
    (vLLM, Ray, Prefect, MLflow) would cost each xdist worker seconds for tests it then deselects."""
    if config.option.markexpr.strip() != "not slow" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return True if _module_markers(collection_path) & {"slow", *_AREA_MARKERS} else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using the fixtures above get their area marker; every test with an area marker is
    `slow` (what `./dev fast` leaves out), whether or not it says so itself. Then test files are
    put in the order of what they share (`_order_files_by_what_they_share`)."""
    for item in items:
        for fixture in _FIXTURE_MARKERS.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(_FIXTURE_MARKERS[fixture])
        if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in _AREA_MARKERS):
            item.add_marker("slow")
    _order_files_by_what_they_share(items)


def _order_files_by_what_they_share(items: list[pytest.Item]) -> None:
    """Reorder `items` file by file (tests within a file keep their order, files of one kind the
    order pytest collected them in): files that use Ray alone, then Ray and Prefect, then Prefect
    alone, then the other slow files, then the fast ones. Each shared service then runs one
    stretch per worker (see the module docstring), and the fast files even out the workers' ends."""
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)

    def rank(file_items: list[pytest.Item]) -> int:
        used = set().union(*(getattr(i, "fixturenames", ()) for i in file_items))
        ray, prefect = bool(used & {SHARED_RAY.fixture, "ray_cluster"}), SHARED_PREFECT.fixture in used
        if ray or prefect:
            return 0 if not prefect else 1 if ray else 2
        return 3 if any(i.get_closest_marker("slow") for i in file_items) else 4

    ordered = sorted(by_file.values(), key=rank)  # stable
    items[:] = [item for file_items in ordered for item in file_items]


_SHARED_SERVICES: tuple[SharedService[Any], ...] = (SHARED_RAY, SHARED_PREFECT)


def _stop_prefect_ephemeral_server() -> None:
    """Stop the server Prefect started in this process for a flow run with no API set (it would
    otherwise run until the process exits); the next such run starts it again."""
    import sys

    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for instance in list(server.SubprocessASGIServer._instances.values()):
            if instance.running:
                instance.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a test file's last test: stop each shared service the next file does not use."""
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.path != item.path:
            for service in _SHARED_SERVICES:
                if nextitem is None or service.fixture not in getattr(nextitem, "fixturenames", ()):
                    service.stop()
            _stop_prefect_ephemeral_server()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Whatever is still running when the session ends early (-x, Ctrl-C)."""
    for service in _SHARED_SERVICES:
        service.stop()
