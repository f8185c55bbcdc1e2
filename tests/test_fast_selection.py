"""`./dev fast` (`-m "not slow"`) does not import a test file whose every test is slow
(tests/conftest.py, `pytest_ignore_collect`): read from the file's source, so a file that says
`slow` (or an area marker, which implies it) at module level costs the quick loop nothing, and
every other file is still collected and its tests selected one by one."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from conftest import pytest_ignore_collect  # tests/ is on sys.path (pytest rootdir conftest)

TESTS = Path(__file__).resolve().parent


def _config(markexpr: str) -> pytest.Config:
    return types.SimpleNamespace(option=types.SimpleNamespace(markexpr=markexpr))  # type: ignore[return-value]


@pytest.mark.parametrize(("source", "skipped"), [
    ("import pytest\npytestmark = pytest.mark.slow\n", True),
    ("import pytest\npytestmark = [pytest.mark.prefect, pytest.mark.timeout(1200)]  # area marker: slow\n", True),
    ("import pytest\npytestmark = [\n    pytest.mark.gpu,\n    pytest.mark.distributed,\n]\n", True),
    ("import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n\ndef test_y():\n    pass\n", False),  # one by one
    ("import pytest\npytestmark = pytest.mark.gpu\n", False),
    ("pytestmark = (\n", False),  # pytest imports it and reports the error
])
def test_a_file_is_left_unimported_only_when_every_test_in_it_is_slow(tmp_path, source, skipped):
    path = tmp_path / "test_file.py"
    path.write_text(source)
    assert pytest_ignore_collect(path, _config("not slow")) is (True if skipped else None)


def test_only_the_quick_selection_leaves_files_out(tmp_path):
    path = tmp_path / "test_file.py"
    path.write_text("import pytest\npytestmark = pytest.mark.slow\n")
    for markexpr in ("", "slow", "ray or not slow", "not gpu"):
        assert pytest_ignore_collect(path, _config(markexpr)) is None, markexpr
    helper = tmp_path / "ray_cluster.py"  # a helper module, not a test file
    helper.write_text(path.read_text())
    assert pytest_ignore_collect(helper, _config("not slow")) is None


def test_the_suites_vllm_files_are_left_out_of_the_quick_loop():
    """The files that import vLLM at module level: each xdist worker paid seconds for them."""
    for name in ("test_rollout_vllm.py", "test_rollout_vllm_tp.py"):
        assert pytest_ignore_collect(TESTS / name, _config("not slow")) is True, name
