"""scripts/gpu_carry.py: the folder carried to the lent GPU machine is complete, and its `install`
there installs only what that machine lacks (or has at a version a carried package rules out).

The plan and the install run on real wheels (tiny ones made here, and the carried ones where this
machine's cache has them: nothing is downloaded by these tests)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


carry = load("gpu_carry", ROOT / "scripts" / "gpu_carry.py")


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel with one module `<name>_mod.py` that says its version."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}_mod.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name_in_zip, text in files.items():
            zf.writestr(name_in_zip, text)
    return path


def wheels_of(folder: Path, *specs: tuple[str, str, tuple[str, ...]]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for name, version, requires in specs:
        make_wheel(folder, name, version, requires)
    return carry.read_wheels(folder)


def test_plan_installs_what_is_missing_or_ruled_out_and_names_what_neither_side_meets(tmp_path):
    wheels = wheels_of(tmp_path, ("app", "1.0", ("lib-a>=2", "lib-b", "lib-c>=1.5", "lib-d")),
                       ("lib-a", "2.1", ()), ("lib-b", "1.0", ("lib-e>=3",)), ("lib-c", "1.6", ()))
    have = {"lib-a": "1.9",  # too old for app: the carried 2.1 goes in
            "lib-b": "0.5",  # any version serves app: kept, and its own needs are the machine's business
            "lib-c": "",     # present, version unknown: assumed, and said so
            "lib-e": "2.0"}
    result = carry.plan(wheels, have, roots=["app"])
    assert [f"{w.name}=={w.version}" for w in result.install] == ["app==1.0", "lib-a==2.1"]
    assert result.kept == {"lib-b": "0.5", "lib-c": ""}
    assert result.assumed == ["app 1.0 needs lib-c>=1.5: the machine's lib-c version is not known here"]
    assert result.unmet == ["app 1.0 needs lib-d: not installed, not carried"]


def test_plan_follows_the_requirements_of_what_it_installs(tmp_path):
    """lib-b is missing, so it is installed, and then its lib-e>=3 rules out the machine's 2.0."""
    wheels = wheels_of(tmp_path, ("app", "1.0", ("lib-b",)), ("lib-b", "1.0", ("lib-e>=3",)), ("lib-e", "3.1", ()))
    result = carry.plan(wheels, {"lib-e": "2.0"}, roots=["app"])
    assert [w.name for w in result.install] == ["app", "lib-b", "lib-e"]
    assert result.unmet == []
    # a carried version the requirement rules out is unmet, not installed
    wheels = wheels_of(tmp_path / "old", ("app", "1.0", ("lib-e>=4",)), ("lib-e", "3.1", ()))
    result = carry.plan(wheels, {}, roots=["app"])
    assert result.unmet == ["app 1.0 needs lib-e>=4: not installed, carried 3.1"]


def test_install_puts_only_the_planned_wheels_into_the_target_and_the_extension_in_place(tmp_path):
    folder = tmp_path / "carry"
    # "packaging" is installed here at a real version: the carried 0.0.1 must not shadow it
    wheels_of(folder / "wheels", ("rlcore-carry-probe", "1.0", ("packaging", "rlcore-carry-dep>=2")),
              ("rlcore-carry-dep", "2.0", ()), ("packaging", "0.0.1", ()))
    (folder / carry.NATIVE).write_bytes(b"not really a shared object")
    package = tmp_path / "rlcore"
    package.mkdir()
    target = tmp_path / "site"
    report = carry.install(folder, target, package, roots=["rlcore-carry-probe"])
    assert report["install"] == ["rlcore-carry-dep==2.0", "rlcore-carry-probe==1.0"] and report["unmet"] == []
    assert "packaging" in report["kept"]
    assert sorted(p.name for p in target.glob("*_mod.py")) == ["rlcore_carry_dep_mod.py", "rlcore_carry_probe_mod.py"]
    assert (package / carry.NATIVE).read_bytes() == b"not really a shared object"
    proc = subprocess.run([sys.executable, "-c", "import rlcore_carry_probe_mod as m; print(m.VERSION)"],
                          env={"PYTHONPATH": str(target)}, capture_output=True, text=True)
    assert proc.stdout.strip() == "1.0", proc.stderr
    again = carry.install(folder, target, package, roots=["rlcore-carry-probe"])
    assert again["native"].endswith("already the carried build")


def test_the_trl_pin_is_the_one_the_side_by_side_expects():
    bench = load("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
    assert ("trl", bench.TRL_VERSION) in carry.read_pins()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict]:
    """`prepare --offline` into a fresh folder, from this machine's wheel cache (skip without it)."""
    pins = carry.read_pins()
    cached = carry.read_wheels(carry.CACHE) if carry.CACHE.exists() else {}
    missing = [f"{n}=={v}" for n, v in pins if n not in cached or cached[n].version != v]
    if missing:
        pytest.skip(f"the carried wheels are not cached in {carry.CACHE} ({', '.join(missing)}): "
                    "./dev python scripts/gpu_carry.py prepare downloads them")
    if not (ROOT / "rlcore" / carry.NATIVE).exists():
        pytest.skip(f"rlcore/{carry.NATIVE} is not built")
    folder = tmp_path_factory.mktemp("carry") / ".gpu_carry"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "prepare", "--offline", "--dir", str(folder)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, json.loads(proc.stdout)


@pytest.mark.slow  # `prepare` and `check` as processes over the whole wheel cache; fast: the install and probe tests above
def test_prepared_folder_is_complete_for_the_gpu_machine(prepared):
    folder, report = prepared
    assert report["ok"] and report["problems"] == []
    names = {w.name: w.version for w in carry.read_wheels(folder / "wheels").values()}
    assert names == dict(carry.read_pins())
    assert report["on_the_gpu_machine"]["unmet"] == []
    # what the machine was seen to lack goes in; its torch stack is never shadowed
    to_install = {line.split("==")[0] for line in report["on_the_gpu_machine"]["install"]}
    assert {"pydantic", "pydantic-core", "trl", "datasets", "dill", "multiprocess"} <= to_install
    assert not to_install & {"torch", "transformers", "triton", "numpy", "pandas", "pyarrow"}
    assert (folder / carry.NATIVE).read_bytes() == (ROOT / "rlcore" / carry.NATIVE).read_bytes()
    assert report["tree_mib"] + report["folder_mib"] <= 64
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["target_python"] == "3.12" and len(manifest["wheels"]) == len(names)


@pytest.mark.slow  # see test_prepared_folder_is_complete_for_the_gpu_machine
def test_check_names_a_missing_wheel_and_what_needed_it(prepared, tmp_path):
    folder, _ = prepared
    broken = tmp_path / ".gpu_carry"
    shutil.copytree(folder, broken)
    (dill,) = (broken / "wheels").glob("dill-*.whl")
    dill.unlink()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "check", "--dir", str(broken)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    problems = json.loads(proc.stdout)["problems"]
    assert any("dill==" in p and "pinned but not in" in p for p in problems), problems
    assert any(p.startswith("unmet on the GPU machine: multiprocess") and "needs dill" in p and "not carried" in p
               for p in problems), problems
