"""`Batch.info` holds data about the batch only (the loader's epoch, how `concat` right-pads): what
to do with a batch (sampling parameters, samples per prompt, an objective, a temperature) is a
typed argument of the worker method, and metrics come back beside a batch, never inside it
(`rlcore.trainer.groups`). The scan below fails on a new control key written or read anywhere in
rlcore, as `test_algorithm_traits.py` does for algorithm-name checks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlcore
from rlcore.protocol import RIGHT_PAD

PACKAGE = Path(rlcore.__file__).resolve().parent
DATA_KEYS = {"epoch", RIGHT_PAD}  # what info may say about a batch
ACCESSORS = {"get", "pop", "setdefault", "update"}


def _key(node: ast.expr) -> str:
    """A key as written: a string literal, or the name of the constant holding one (RIGHT_PAD)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id == "RIGHT_PAD":
        return RIGHT_PAD
    return f"<{ast.unparse(node)}>"


def _is_info(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "info"


def info_keys(source: str, filename: str) -> list[tuple[str, str]]:
    """(where, key) for each key of a `Batch.info` written or read: `x.info[k]`, `x.info.get(k)`
    (pop, setdefault), `x.info.update(k=...)`, `Batch(..., info={k: ...})`, `{**x.info, k: ...}`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Subscript) and _is_info(node.value):
            found.append((where, _key(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_info(node.func.value) \
                and node.func.attr in ACCESSORS:
            found += [(where, _key(a)) for a in node.args[:1] if not isinstance(a, ast.Dict)]
            found += [(where, k.arg) for k in node.keywords if k.arg]
            found += [(where, _key(k)) for a in node.args[:1] if isinstance(a, ast.Dict) for k in a.keys if k is not None]
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "info" and isinstance(kw.value, ast.Dict):
                    found += [(where, _key(k)) for k in kw.value.keys if k is not None]
        elif isinstance(node, ast.Dict) and any(k is None and _is_info(v) for k, v in zip(node.keys, node.values)):
            found += [(where, _key(k)) for k in node.keys if k is not None]  # {**batch.info, k: ...}
    return found


def test_batch_info_carries_no_control_values_in_rlcore():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "protocol.py":  # `Batch` itself: concat, union, equality over whatever keys info has
            continue
        found += [f"{where}: info[{key!r}]" for where, key in info_keys(path.read_text(), str(path.relative_to(PACKAGE.parent)))
                  if key not in DATA_KEYS]
    assert found == [], "control values in Batch.info (make them typed arguments, or return metrics):\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "key"), [
    ('prompts.info["sampling"] = {}', "sampling"),
    ('n = gen.info.get("n", 1)', "n"),
    ('m = out.info.pop("metrics")', "metrics"),
    ("batch.info.update(algorithm='dpo')", "algorithm"),
    ('b = Batch(tensors={}, info={"temperature": 1.0})', "temperature"),
    ('info = {**batch.info, "temperature": t}', "temperature"),
])
def test_the_scan_finds_each_form(source, key):
    assert [k for _, k in info_keys(source, "x.py")] == [key]


def test_the_scan_leaves_plain_dicts_named_info_alone():
    assert info_keys('info = {}\ninfo["dtype"] = 1\ninfo.update(messages=[])', "x.py") == []
