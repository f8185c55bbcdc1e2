"""The wheel as a user gets it: built by maturin, installed into a fresh virtual environment, and
`rlcore pipeline run` / `rlcore pipeline serve --help` run from an empty folder outside the
repository, with the repository nowhere on sys.path. The flows, the example configs and the
native extension must all come from the installed package.

The new environment reuses the cached environment's packages through a .pth file that calls
site.addsitedir on its site-packages (so their own .pth files work too): rlcore is installed
without dependencies, and nothing else is downloaded."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import prefect_env  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128", "registry.promotion_margin=-1"]

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]  # a pipeline run in Prefect's ephemeral mode


def _run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=scaled(timeout), **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(out: Path) -> Path:
    """`maturin build --release` as scripts/env.sh does it (cargo's cache outside the clone, one
    builder at a time under the same lock as ./dev's native build)."""
    env = dict(os.environ, CARGO_TARGET_DIR=os.environ.get("CARGO_TARGET_DIR", str(CACHE / "cargo-target")))
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "native.build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run([sys.executable, "-m", "maturin", "build", "--release", "--auditwheel", "skip", "-i", sys.executable,
              "-o", str(out)], timeout=900, cwd=ROOT, env=env)
    [wheel] = out.glob("rlcore-*.whl")
    return wheel


def venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv holding only the wheel, seeing the cached environment's other packages."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60).stdout.strip()
    env_site = sysconfig.get_paths()["purelib"]
    # After the venv's own site-packages (where rlcore goes): the installed rlcore wins.
    (Path(purelib) / "zz_rlcore_cached_env.pth").write_text(f"import site; site.addsitedir({env_site!r})\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
          str(wheel)], timeout=300)
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    return venv_with(build_wheel(base / "dist"), base / "venv")


def outside_env(home: Path) -> dict[str, str]:
    """The user's environment: nothing pointing at the repository, Prefect and MLflow local."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PREFECT_API_URL", "MLFLOW_TRACKING_URI", "VIRTUAL_ENV")}
    env.update(prefect_env(home / "prefect"), OMP_NUM_THREADS="1")
    return env


def test_installed_wheel_runs_the_pipeline_outside_the_repository(installed, tiny_example, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = outside_env(tmp_path)
    python, rlcore_cmd = installed / "bin" / "python", installed / "bin" / "rlcore"

    where = json.loads(_run([str(python), "-c", "import json, sys, rlcore, rlcore.flows, rlcore._native; "
                             "print(json.dumps([rlcore.__file__, rlcore.flows.__file__, sys.path]))"],
                            timeout=120, cwd=empty, env=env).stdout)
    package = installed.resolve()
    assert Path(where[0]).resolve().is_relative_to(package) and Path(where[1]).resolve().is_relative_to(package)
    assert not any(p and Path(p).resolve().is_relative_to(ROOT) for p in where[2]), where[2]

    helped = _run([str(rlcore_cmd), "pipeline", "serve", "--help"], timeout=120, cwd=empty, env=env)
    assert "--watch" in helped.stdout and "--unresponsive-after" in helped.stdout

    done = _run([str(rlcore_cmd), "pipeline", "run", "--json", *QUICK], timeout=600, cwd=empty, env=env)
    summary = json.loads(done.stdout)
    assert summary["steps"] == 2 and summary["version"] == "1" and summary["champion"] is True
    # (What the run computed -- the base model's accuracy, the registry, MLflow's runs -- is
    # test_pipeline_run's, on the same code; here: that the installed package runs it at all.)
    assert Path(summary["run_dir"]).resolve().is_relative_to(empty.resolve())
    assert (empty / "mlflow.db").is_file()
    # The flow run carries the pipeline run's name (Prefect, MLflow and notifications agree).
    assert f"Beginning flow run '{summary['pipeline_run']}' for flow 'rl_pipeline'" in done.stderr
    assert not (empty / "flows").exists() and not (empty / "prefect.yaml").exists()
