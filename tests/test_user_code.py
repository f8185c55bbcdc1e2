"""User code (tool files, reward functions, interactions) is loaded in a child interpreter first
(`rlcore.rewards.user_code`): a file that calls `sys.exit(0)`, loops, kills its interpreter or
crashes at import is one error line naming the spec and the file, within the load bound
(`RLCORE_USER_CODE_TIMEOUT_S`), and never the command's own exit or hang. Tool files are never
imported in the asking process at all (their schemas come from the child). Real files, real
child interpreters, the real `rlcore` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides
from rlcore.rewards.registry import SpecError, load_function
from rlcore.rewards.tools import ToolSpecError, load_tools, tool_schemas
from rlcore.rewards.user_code import describe

TOOL = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''

HOSTILE = {
    "exit0": ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
    "exit_text": ("import sys\nsys.exit('bye')\n", "called sys.exit('bye')"),
    "loops": ("import time\nwhile True:\n    time.sleep(0.5)\n", "did not finish within 15 s"),
    "os_exit": ("import os\nprint('going now', flush=True)\nos._exit(0)\n", "ended its interpreter (exit status 0); "
                "its last output: going now"),
    "segfault": ("import ctypes\nctypes.string_at(0)\n", "ended its interpreter (exit status -11)"),
    "raises": ("raise RuntimeError('broken at import')\n", "RuntimeError: broken at import"),
    "keyboard": ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
}


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RLCORE_USER_CODE_TIMEOUT_S", "15")  # the looping file: no need to wait 120 s
    for name, (prefix, _) in HOSTILE.items():
        (tmp_path / f"{name}.py").write_text(prefix + TOOL)
    (tmp_path / "good.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'a').write('x')\n" + TOOL)
    return tmp_path


# Each case is a child interpreter (~2 CPU s): `./dev fast` keeps one per way a file can end its
# import (exit0: sys.exit, loops: the bound, os_exit and segfault: the interpreter ends, raises: an
# exception); exit_text and keyboard take the same paths as exit0 and raises and run in the full suite.
_SAME_PATH_AS_A_FAST_CASE = {"exit_text", "keyboard"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SAME_PATH_AS_A_FAST_CASE else n
                                  for n in sorted(HOSTILE)])
def test_a_hostile_file_is_one_error_naming_it(files, name):
    spec = f"{files / name}.py:add"
    with pytest.raises(ToolSpecError) as err:
        load_tools([spec])
    message = str(err.value)
    assert spec in message and HOSTILE[name][1] in message and "\n" not in message, message


def test_a_tool_file_is_imported_by_the_child_only_and_once_per_process(files):
    spec = f"{files / 'good.py'}:add"
    [tool] = load_tools([spec]).values()
    assert tool.schema["function"]["name"] == "add" and tool.schema["function"]["parameters"]["required"] == ["a", "b"]
    assert tool_schemas([spec]) == [tool.schema]  # preflight, loaders, tool pool: one child between them
    assert describe([spec], "tool", ToolSpecError, schemas=True) == [tool.schema]
    assert (files / "imported").read_text() == "x"  # one child import, none here
    assert not any(str(files) in str(getattr(m, "__file__", "") or "") for m in list(sys.modules.values()))
    (files / "good.py").write_text((files / "good.py").read_text() + "\n# edited\n")  # a new version loads again
    load_tools([spec])
    assert (files / "imported").read_text() == "xx"


@pytest.mark.slow  # waits out the 15 s bound once more (test_a_hostile_file_is_one_error_naming_it[loops] is the fast check)
def test_the_bound_counts_per_file(files):
    """A slow import before a hung one does not eat the hung one's time; the good one's result stays."""
    (files / "slow.py").write_text("import time\ntime.sleep(2)\n" + TOOL)
    specs = [f"{files / 'slow.py'}:add", f"{files / 'loops.py'}:add"]
    with pytest.raises(SpecError, match=r"loops\.py:add'?: loading it did not finish within 15 s"):
        describe(specs, "tool", ToolSpecError, schemas=True)
    assert describe(specs[:1], "tool", ToolSpecError, schemas=True)[0]["function"]["name"] == "add"


def test_sys_exit_in_code_imported_here_is_an_error_not_an_exit(files):
    """Where a file is imported in process after its check (an interaction, scoring with
    num_workers=0), sys.exit is an error naming it too."""
    with pytest.raises(SpecError, match=r"exit0\.py called sys\.exit\(0\)"):
        load_function(f"{files / 'exit0.py'}:add", "interaction")


def test_the_bound_setting_is_checked(files, monkeypatch):
    monkeypatch.setenv("RLCORE_USER_CODE_TIMEOUT_S", "soon")
    with pytest.raises(SpecError, match="RLCORE_USER_CODE_TIMEOUT_S='soon': expected a positive number"):
        load_tools([f"{files / 'raises.py'}:add"])


@pytest.mark.parametrize(("command", "key", "name"), [("sft", "data.tools[0]", "exit0"),
                                                      # the 15 s bound again: [loops] above and [sft-...-exit0] are fast
                                                      pytest.param("sft", "data.tools[0]", "loops", marks=pytest.mark.slow),
                                                      ("train", "reward.function", "exit0"),
                                                      # fast: [os_exit] above and [train-reward.function-exit0]
                                                      pytest.param("train", "rollout.agent.tools[0]", "os_exit",
                                                                   marks=pytest.mark.slow)])
def test_the_command_refuses_it_in_one_line(tiny_example, files, capsys, command, key, name):
    spec = f"{files / name}.py:{'compute_score' if key == 'reward.function' else 'add'}"
    out = files / "run"
    if command == "sft":
        args = ["sft", str(CONFIG_DIR / "tiny_sft.yaml"), f"model.path={tiny_example.model_dir}",
                f"data.train_files=[{tiny_example.sft_file}]", f"data.tools=[{spec}]", f"trainer.output_dir={out}"]
    else:
        value = f"[{spec}]" if key.startswith("rollout") else spec
        args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(out)),
                f"{key.removesuffix('[0]')}={value}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if spec in ln]
    assert line.strip().removeprefix("rlcore: error: ").startswith(key) and HOSTILE[name][1] in line, err
    assert "Traceback" not in err and not (out / "checkpoints").exists()


@pytest.mark.slow  # a real process; in process: test_the_command_refuses_it_in_one_line[sft-data.tools[0]-exit0]
def test_rlcore_sft_with_a_tool_file_that_exits_exits_2(tiny_example, files):
    """The issue's case, as a user runs it: before, exit status 0 with nothing trained."""
    spec = f"{files / 'exit0.py'}:add"
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", "sft", str(CONFIG_DIR / "tiny_sft.yaml"),
                           f"model.path={tiny_example.model_dir}", f"data.train_files=[{tiny_example.sft_file}]",
                           f"data.tools=[{spec}]", f"trainer.output_dir={files / 'run'}"],
                          capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 2, done.stderr
    assert f"data.tools[0]: '{spec}': executing {files / 'exit0.py'} called sys.exit(0)" in done.stderr
    assert "Traceback" not in done.stderr and not (files / "run" / "model").exists()
