"""The folder that goes to the lent GPU machine with the tree, and its installation there.

    ./dev python scripts/gpu_carry.py prepare [--dir .gpu_carry] [--offline]   # here
    ./dev python scripts/gpu_carry.py check [--dir .gpu_carry]                   # here: is it complete?
    python scripts/gpu_carry.py install --target DIR [--report FILE]           # there (scripts/gpu_check_device.sh)

Why: the GPU machine (shared/FIELD_NOTES.md "The GPU machine") has Python 3.12, torch 2.11, triton
3.6, transformers 5.17, pandas and pyarrow, and no network; rlcore needs pydantic there and
benchmarks/gpu_check.py's trl phase needs TRL. The device tool carries the tree's tracked and
untracked files plus up to 8 ignored paths, 64 MiB in all, so everything else travels in one ignored
folder (`.gpu_carry/`, named in the call's `carry`):

    wheels/            requirements/gpu-carry.txt's pins for CPython 3.12 on manylinux x86_64
                       (pip download --no-deps --only-binary=:all:), cached under $RLCORE_CACHE/gpu-carry
    _native.abi3.so    rlcore's built extension (abi3: the 3.11 build loads on 3.12)
    manifest.json      the pins, the tree's commit, the extension's sha256, the sizes

`install` runs with the GPU machine's own Python and reads what it has installed: it installs a
carried wheel where the machine lacks that distribution, or has it at a version that a requirement
of what is being installed (or of the roots: pydantic, TRL, datasets) rules out, with
`pip install --no-index --no-deps --target DIR` (the dependencies are resolved here, by `plan`), so
the machine's torch stack is never shadowed by a copy. Requirements neither the machine nor the
folder meets are listed (stderr and --report), not hidden: gpu_check's phases then fail by name.

`check` runs the same `plan` against what the GPU machine is known to have (`gpu_machine()`), so an
incomplete folder fails here and not in the lent minutes; it also installs every carried wheel into a
temporary --target with pip's 3.12/manylinux tag rules and checks the 64 MiB limit.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "requirements" / "gpu-carry.txt"
CARRY_DIR = ROOT / ".gpu_carry"
NATIVE = "_native.abi3.so"
CACHE = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore")) / "gpu-carry" / "wheels"
LIMIT_BYTES = 64 * 2**20  # what one device call carries: the tree and the named ignored paths together
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")  # torch 2.11's wheels need glibc >= 2.28 there
# What must import there: rlcore's config layer (pyproject: pydantic>=2.7), TRL and datasets, Liger
# Kernel (their versions: the pins).
ROOTS = ("pydantic>=2.7", "trl", "datasets", "liger-kernel")
# What FIELD_NOTES records on the GPU machine, with the versions it names; what these require is
# there too (read from this environment's metadata, versions unknown: `gpu_machine`).
GPU_MACHINE_HAS = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "pandas": "", "pyarrow": ""}
# ... and what it was seen to lack (the wheels the 2026-12-04 run had to carry), whatever this
# environment's newer transformers requires (typer -> pydantic).
GPU_MACHINE_LACKS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "trl", "datasets", "dill",
                     "multiprocess", "liger-kernel")


def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


# ----------------------------------------------------------------------------- wheels and the plan

@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # canonical
    version: str
    requires: tuple[str, ...]  # Requires-Dist lines


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version and requirements, from its METADATA."""
    from email.parser import HeaderParser

    with zipfile.ZipFile(path) as zf:
        (meta,) = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        headers = HeaderParser().parsestr(zf.read(meta).decode())
    return Wheel(path, _canon(headers["Name"]), headers["Version"], tuple(headers.get_all("Requires-Dist") or ()))


def read_wheels(folder: Path) -> dict[str, Wheel]:
    return {w.name: w for w in map(read_wheel, sorted(folder.glob("*.whl")))}


@dataclass
class Plan:
    install: list[Wheel] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> the machine's version ("" unknown) that serves
    unmet: list[str] = field(default_factory=list)  # "<who> needs <req>: <why>"
    assumed: list[str] = field(default_factory=list)  # requirements taken as met by a version not known here

    def summary(self) -> dict[str, object]:
        return {"install": [f"{w.name}=={w.version}" for w in self.install], "kept": self.kept,
                "unmet": self.unmet, "assumed": self.assumed}


def plan(wheels: Mapping[str, Wheel], have: Mapping[str, str], roots: Iterable[str] = ROOTS,
         environment: Mapping[str, str] | None = None) -> Plan:
    """Which carried wheels to install on a machine that `have`s these distributions (canonical
    name -> version, "" where present at an unknown version): the roots' requirements and, for
    every wheel chosen, its own, until nothing changes. A requirement is met by the machine's
    version where it satisfies every specifier asking for that name, else by the carried wheel."""
    from packaging.requirements import Requirement

    env = {**(environment or {}), "extra": ""}
    roots = list(roots)
    chosen: dict[str, Wheel] = {}
    while True:
        needs: dict[str, list[tuple[str, Requirement]]] = {}
        for who, lines in [("roots", roots)] + [(f"{w.name} {w.version}", w.requires) for w in chosen.values()]:
            for line in lines:
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate(env):
                    needs.setdefault(_canon(req.name), []).append((who, req))
        out = Plan()
        for name, reqs in sorted(needs.items()):
            installed = have.get(name)
            if installed is not None and (installed == "" or all(r.specifier.contains(installed, prereleases=True) for _, r in reqs)):
                out.kept[name] = installed
                out.assumed += [f"{who} needs {r}: the machine's {name} version is not known here" for who, r in reqs
                                if installed == "" and r.specifier]
                continue
            wheel = wheels.get(name)
            bad = [f"{who} needs {r}" for who, r in reqs if wheel is None or not r.specifier.contains(wheel.version, prereleases=True)]
            if bad:
                has = "not installed" if installed is None else f"the machine has {installed}"
                carried = "not carried" if wheel is None else f"carried {wheel.version}"
                out.unmet += [f"{b}: {has}, {carried}" for b in bad]
            else:
                out.install.append(wheel)
        if {w.name for w in out.install} <= set(chosen):  # nothing new: the plan is closed
            out.install.sort(key=lambda w: w.name)
            return out
        chosen.update((w.name, w) for w in out.install)


def installed_here() -> dict[str, str]:
    """Canonical name -> version of every distribution this interpreter sees (sys.path order: the
    first one found wins, as for imports)."""
    have: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            have.setdefault(_canon(name), dist.version)
    return have


def gpu_machine() -> dict[str, str]:
    """What the GPU machine has, as far as known here: GPU_MACHINE_HAS at its recorded versions,
    and everything those require by this environment's metadata at versions unknown (""), less
    GPU_MACHINE_LACKS."""
    from packaging.requirements import Requirement

    env = _target_environment()
    have: dict[str, str] = {}
    queue = list(GPU_MACHINE_HAS)
    while queue:
        name = _canon(queue.pop())
        if name in have or name in GPU_MACHINE_LACKS:
            continue
        have[name] = GPU_MACHINE_HAS.get(name, "")
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                queue.append(req.name)
    return have


def _target_environment() -> dict[str, str]:
    """PEP 508 marker values of the GPU machine (CPython 3.12 on Linux x86_64)."""
    from packaging.markers import default_environment

    return {**default_environment(), "python_version": TARGET_PYTHON, "python_full_version": f"{TARGET_PYTHON}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


# ----------------------------------------------------------------------------- prepare (here)

def read_pins(path: Path = PINS) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: {raw!r} is not pinned (name==version)")
            pins.append((_canon(name), version.strip()))
    return pins


def platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for platform in TARGET_PLATFORMS:
        args += ["--platform", platform]
    return args


def download(pins: list[tuple[str, str]], cache: Path, offline: bool) -> dict[str, Wheel]:
    """The pinned wheels, from the cache or downloaded into it (only those not there yet)."""
    cache.mkdir(parents=True, exist_ok=True)
    have = read_wheels(cache)
    missing = [f"{n}=={v}" for n, v in pins if n not in have or have[n].version != v]
    if missing and offline:
        raise SystemExit(f"gpu_carry: not in {cache} and --offline: {', '.join(missing)}")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform_args(), "-d", str(cache),
                        *missing], check=True)
    wheels = {w.name: w for w in map(read_wheel, sorted(cache.glob("*.whl")))
              if (w.name, w.version) in set(pins)}
    lost = [f"{n}=={v}" for n, v in pins if n not in wheels]
    if lost:
        raise SystemExit(f"gpu_carry: pip download left no wheel for {', '.join(lost)} in {cache}")
    return wheels


def tree_bytes() -> int:
    """Bytes of the files the device tool copies: tracked and untracked-but-not-ignored files."""
    names = subprocess.check_output(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(folder: Path, offline: bool) -> dict[str, object]:
    """Fill `folder` anew: the pinned wheels, the built extension, manifest.json; then `check` it."""
    native = ROOT / "rlcore" / NATIVE
    if not native.exists():
        raise SystemExit(f"gpu_carry: {native} is not built; any ./dev command builds it (./dev setup)")
    wheels = download(read_pins(), CACHE, offline)
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "wheels").mkdir(parents=True)
    for wheel in wheels.values():
        shutil.copy2(wheel.path, folder / "wheels" / wheel.path.name)
    shutil.copy2(native, folder / NATIVE)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    manifest = {"pins": PINS.read_text(), "wheels": sorted(w.path.name for w in wheels.values()), "tree_commit": commit,
                "native_sha256": _sha256(native), "target_python": TARGET_PYTHON, "target_platforms": list(TARGET_PLATFORMS)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return check(folder)


def check(folder: Path) -> dict[str, object]:
    """The folder is complete for the GPU machine: every pin there, the plan against `gpu_machine()`
    leaves nothing unmet, every wheel installs under pip's 3.12/manylinux tag rules, the extension
    is the current build, and the tree plus the folder fit the device tool's 64 MiB."""
    problems: list[str] = []
    wheels = read_wheels(folder / "wheels")
    missing = [f"{n}=={v}" for n, v in read_pins() if n not in wheels or wheels[n].version != v]
    if missing:
        problems.append(f"pinned but not in {folder}/wheels: {', '.join(missing)}")
    result = plan(wheels, gpu_machine(), environment=_target_environment())
    problems += [f"unmet on the GPU machine: {u}" for u in result.unmet]
    native = folder / NATIVE
    if not native.exists():
        problems.append(f"{native} is missing")
    elif (ROOT / "rlcore" / NATIVE).exists() and _sha256(native) != _sha256(ROOT / "rlcore" / NATIVE):
        problems.append(f"{native} is not the current build of rlcore/{NATIVE}: prepare again")
    with tempfile.TemporaryDirectory(prefix="gpu_carry_check_") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", tmp,
                               *platform_args(), *[str(w.path) for w in wheels.values()]], capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"pip could not install the wheels for Python {TARGET_PYTHON}: {proc.stderr.strip()[-1500:]}")
    tree, carried = tree_bytes(), folder_bytes(folder)
    if tree + carried > LIMIT_BYTES:
        problems.append(f"the tree ({tree / 2**20:.1f} MiB) and {folder.name} ({carried / 2**20:.1f} MiB) exceed the "
                        f"device tool's {LIMIT_BYTES // 2**20} MiB")
    report = {"folder": str(folder), "ok": not problems, "problems": problems, "tree_mib": round(tree / 2**20, 2),
              "folder_mib": round(carried / 2**20, 2), "limit_mib": LIMIT_BYTES // 2**20,
              "on_the_gpu_machine": result.summary()}
    return report


# ----------------------------------------------------------------------------- install (there)

def install(folder: Path, target: Path, native_to: Path | None, roots: Iterable[str] = ROOTS) -> dict[str, object]:
    """On the GPU machine: the plan against what this interpreter has, those wheels into `target`
    (a fresh folder), and the extension into the rlcore package where it is not the same file."""
    wheels = read_wheels(folder / "wheels")
    result = plan(wheels, installed_here(), roots)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    if result.install:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check",
                        "--target", str(target), *[str(w.path) for w in result.install]], check=True)
    report: dict[str, object] = {"python": sys.version.split()[0], "target": str(target), **result.summary()}
    if native_to is not None:
        src, dst = folder / NATIVE, native_to / NATIVE
        if not dst.exists() or _sha256(dst) != _sha256(src):
            shutil.copy2(src, dst)
            report["native"] = f"copied to {dst}"
        else:
            report["native"] = f"{dst} already the carried build"
    for line in result.unmet:
        print(f"gpu_carry: unmet: {line}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="fill the folder (here) and check it")
    p.add_argument("--dir", type=Path, default=CARRY_DIR)
    p.add_argument("--offline", action="store_true", help=f"use only wheels already in {CACHE}")
    c = sub.add_parser("check", help="is the folder complete for the GPU machine")
    c.add_argument("--dir", type=Path, default=CARRY_DIR)
    i = sub.add_parser("install", help="on the GPU machine: install what it lacks into --target")
    i.add_argument("--dir", type=Path, default=CARRY_DIR)
    i.add_argument("--target", type=Path, required=True)
    i.add_argument("--native-to", type=Path, default=ROOT / "rlcore", help="where rlcore's extension goes")
    i.add_argument("--report", type=Path, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.command == "install":
        report = install(args.dir, args.target, args.native_to)
        if args.report:
            args.report.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report))
        return 0
    report = prepare(args.dir, args.offline) if args.command == "prepare" else check(args.dir)
    print(json.dumps(report, indent=1))
    if report["ok"]:
        print(f"\n{args.dir} is ready ({report['folder_mib']} MiB + the tree's {report['tree_mib']} MiB of "
              f"{report['limit_mib']}). On the GPU machine, one call (device tool: carry [\"{args.dir.name}\"]):\n"
              "    bash scripts/gpu_check_device.sh", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
