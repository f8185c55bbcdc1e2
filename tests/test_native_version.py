"""The Rust extension is checked at `import rlcore`: one version everywhere, a stale or missing
build is an error naming the fix, and RLCORE_NATIVE=off is the only (logged) way to run without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

import rlcore
from rlcore import _native, native
from rlcore.algos import group_outcome_advantage
from rlcore.native import REQUIRED_FUNCTIONS, NativeBuildError, check_module

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter on this checkout, with `env` added to the environment."""
    full_env = {k: v for k, v in os.environ.items() if k != native.ENV_VAR}
    full_env.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=scaled(120), cwd=ROOT)


def fake_native(version: str, missing: tuple[str, ...] = ()) -> ModuleType:
    mod = ModuleType("rlcore._native")
    mod.__version__ = version  # type: ignore[attr-defined]
    for name in REQUIRED_FUNCTIONS:
        if name not in missing:
            setattr(mod, name, lambda *a, **k: None)
    return mod


def test_one_version_in_crate_package_and_built_extension():
    cargo = tomllib.loads((ROOT / "rust" / "Cargo.toml").read_text())["package"]["version"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The wheel's version comes from the crate (maturin), so pyproject must not pin its own.
    assert "version" not in project and "version" in project["dynamic"]
    assert rlcore.__version__ == cargo
    assert _native.__version__ == cargo, "the extension in place was built from other sources"


def test_check_module_accepts_the_real_extension_and_rejects_others():
    check_module(_native, rlcore.__version__)
    with pytest.raises(NativeBuildError, match=r"version '0\.0\.1' but rlcore is '0\.1\.0': a stale build; rebuild"):
        check_module(fake_native("0.0.1"), "0.1.0")
    with pytest.raises(NativeBuildError, match=r"version None"):
        check_module(ModuleType("rlcore._native"), "0.1.0")
    with pytest.raises(NativeBuildError, match=r"lacks \['pack_token_budget'\]"):
        check_module(fake_native("0.1.0", missing=("pack_token_budget",)), "0.1.0")


def test_import_rlcore_fails_on_a_stale_extension():
    done = run_python("""
        import sys, types
        stale = types.ModuleType("rlcore._native")
        stale.__version__ = "9.9.9"
        sys.modules["rlcore._native"] = stale
        import rlcore.algos
    """)
    assert done.returncode != 0
    assert "NativeBuildError" in done.stderr
    assert "version '9.9.9' but rlcore is" in done.stderr and "./dev setup" in done.stderr


def test_import_rlcore_fails_without_the_extension():
    done = run_python("""
        import sys
        sys.modules["rlcore._native"] = None  # what Python does for a module that is not there
        import rlcore.packing
    """)
    assert done.returncode != 0
    assert "NativeBuildError: rlcore._native cannot be imported" in done.stderr
    assert "RLCORE_NATIVE=off" in done.stderr


def test_off_switch_runs_the_reference_code_and_says_so():
    done = run_python("""
        import sys
        sys.modules["rlcore._native"] = None  # off must not even try to import it
        import torch
        from rlcore import native
        from rlcore.algos import group_outcome_advantage
        from rlcore.packing import balanced_partitions, pack_token_budget
        assert not native.enabled()
        scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
        print(group_outcome_advantage(scores, torch.tensor([0, 0, 1, 1]), "grpo").tolist())
        print(pack_token_budget([4, 8, 11, 2, 6], 10), balanced_partitions([1, 2, 3, 4], 2))
        try:
            group_outcome_advantage(scores, torch.tensor([0, 0, 1, 1]), "grpo", backend="native")
        except RuntimeError as e:
            print("native refused:", e)
    """, RLCORE_NATIVE="off")
    assert done.returncode == 0, done.stderr
    assert "RLCORE_NATIVE=off: rlcore._native is not loaded" in done.stderr
    adv, packing, native_refused = done.stdout.splitlines()
    # Same numbers as the Rust kernels give in this (native) process.
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    expected = group_outcome_advantage(scores, torch.tensor([0, 0, 1, 1]), "grpo", backend="native")
    assert [float(x) for x in adv.strip("[]").split(", ")] == pytest.approx(expected.tolist(), abs=1e-6)
    assert packing == f"{_native.pack_token_budget([4, 8, 11, 2, 6], 10)} {_native.balanced_partitions([1, 2, 3, 4], 2)}"
    assert "backend='native' but the extension is switched off (RLCORE_NATIVE=off)" in native_refused


def test_unknown_switch_value_is_an_error():
    done = run_python("import rlcore", RLCORE_NATIVE="maybe")
    assert done.returncode != 0
    assert "RLCORE_NATIVE='maybe': expected 'on' (default) or 'off'" in done.stderr
