"""Imports point one way: cli -> flows -> example -> lifecycle -> trainer -> workers ->
controller/rollout/data/rewards/kernels -> packing/checkpoint/tracking -> config -> algos/protocol.

Every import in the package (module level and inside functions) is read from the source; an
import of a higher layer from a lower one fails the test, naming both modules."""

from __future__ import annotations

import ast
from pathlib import Path

import rlcore

PACKAGE = Path(rlcore.__file__).resolve().parent

# Higher imports lower (or its own subpackage); never the other way round. Same level, other
# subpackage: not allowed either (they are meant to be independent of each other).
LAYERS: dict[str, int] = {
    "cli": 10,
    "flows": 9,  # the Prefect flows of the lifecycle (the repository's flows/ re-exports them)
    "example": 8,
    "lifecycle": 7,
    "trainer": 6, "plan": 6,  # the memory planner: workers' layouts and forwards on fake tensors, beside the recipes
    "workers": 5,
    "controller": 4, "rollout": 4, "data": 4, "rewards": 4, "triton_kernels": 4,
    "packing": 3, "checkpoint": 3, "tracking": 3, "flops": 3, "cpus": 3,
    "config": 2,
    "algos": 1, "protocol": 1, "redact": 1,
    "native": 0, "_native": -1,  # the Rust extension and its loader (version check)
    "errors": 0,  # RLCoreError, the base every layer's user-facing errors derive from; imports nothing
    "__init__": 99,  # the package root: its version string and the native check at import; exempt
}


def _part(module: str) -> str | None:
    """The layer name of an `rlcore...` module (`rlcore` itself: its `__init__`)."""
    parts = module.split(".")
    if parts[0] != "rlcore":
        return None
    if len(parts) == 1 or parts[1] not in LAYERS:  # `from rlcore import __version__`: the package itself
        return "__init__"
    return parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "rlcore":
                found += [(node.lineno, f"rlcore.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            raise AssertionError(f"{path}:{node.lineno}: relative import out of its subpackage; use absolute rlcore imports")
    return found


def test_every_package_module_has_a_layer():
    names = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    names |= {p.name.split(".")[0] for p in PACKAGE.glob("_native*.so")}
    assert names <= set(LAYERS), f"modules without a layer in this test: {sorted(names - set(LAYERS))}"


def test_imports_point_one_way():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = path.stem if path.parent == PACKAGE else path.relative_to(PACKAGE).parts[0]
        for line, module in _imports(path):
            there = _part(module)
            if there is None or there == here or "__init__" in (here, there):
                continue
            if LAYERS[there] >= LAYERS[here]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {module} ({there})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)
