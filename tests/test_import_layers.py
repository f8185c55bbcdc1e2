"""Imports point one way: cli -> flows -> example/pipeline_checks -> lifecycle -> trainer -> workers ->
controller/rollout/data/rewards/kernels -> packing/checkpoint/tracking -> config/console_log ->
algos/protocol/algorithms/pipeline_summary.

Every import in the package (module level and inside functions) is read from the source; an
import of a higher layer from a lower one fails the test, naming both modules. Inside a layer no
module may reach itself through its imports (a cycle), function-level imports counted."""

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
    "pipeline_checks": 8,  # `pipeline run/serve`'s inputs checked before Prefect starts (the flow's configs, --ray-address)
    "lifecycle": 7,
    "trainer": 6, "plan": 6,  # the memory planner: workers' layouts and forwards on fake tensors, beside the recipes
    "workers": 5,
    "controller": 4, "rollout": 4, "data": 4, "rewards": 4, "triton_kernels": 4,
    "packing": 3, "checkpoint": 3, "tracking": 3, "flops": 3, "cpus": 3,
    "chat": 3,  # the one rendering of chat messages into ids: RL prompts, agent turns (rollout) and SFT rows (data)
    "config": 2,
    "console_log": 2,  # the `rlcore` loggers on the console and the redacted excepthook, set up by the CLI
    "algos": 1, "protocol": 1, "redact": 1, "algorithms": 1,  # algorithms: the per-algorithm traits table
    "rollout_backends": 1,  # the rollout backends table: each backend's engine class and traits
    "pipeline_summary": 1,  # the text of a pipeline run's summary; imports nothing
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


# ---------------------------------------------------------------------- no cycles inside a layer
def _module_names() -> dict[str, Path]:
    """Dotted name -> file of every module in the package (a package by its `__init__.py`; the
    native extension too, which imports nothing)."""
    names: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in PACKAGE.glob("_native*.so"):
        names[f"rlcore.{path.name.split('.')[0]}"] = path
    return names


def _module_imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every rlcore module `name` imports, at module level or inside functions,
    relative imports resolved; `from pkg import mod` is an import of `pkg.mod` when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, target) for line, target in found if target in known and target != name]


def _path_between(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest import chain start -> ... -> goal (breadth first), or None."""
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for nxt in sorted(graph.get(module, ())):
                if nxt in previous:
                    continue
                previous[nxt] = module
                if nxt == goal:
                    chain = [nxt]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])  # type: ignore[arg-type]
                    return chain[::-1]
                following.append(nxt)
        frontier = following
    return None


def test_no_import_cycle_inside_a_subpackage():
    """No module reaches itself through imports, function-level ones counted: a cycle hidden inside
    a function is still two modules that cannot be understood (or split, or reused) one without the
    other. Across subpackages the layering above already forbids it; this catches the cycles inside
    one (the package root's `__init__`, which imports the native check, is exempt as above)."""
    known = _module_names()
    graph: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], int] = {}
    for name, path in known.items():
        if name == "rlcore" or path.suffix != ".py":
            continue
        for line, target in _module_imports(name, path, known):
            if target != "rlcore":
                graph.setdefault(name, set()).add(target)
                lines.setdefault((name, target), line)
    cycles = set()
    for module, targets in graph.items():
        for target in targets:
            back = _path_between(graph, target, module)
            if back is not None:
                cycle = [module, *back[:-1]]  # back ends where the cycle started
                at = cycle.index(min(cycle))  # one spelling per cycle: from its first name
                cycle = cycle[at:] + cycle[:at]
                steps = [f"{m} (line {lines[(m, cycle[(i + 1) % len(cycle)])]})" for i, m in enumerate(cycle)]
                cycles.add(" -> ".join([*steps, cycle[0]]))
    assert not cycles, "import cycles (each module listed with the line of its import of the next):\n" + "\n".join(sorted(cycles))


# ---------------------------------------------------------------------- inside rlcore.config
# The config package's own order (docs/DESIGN.md, `rlcore/config/`): a module imports only modules
# of a lower level; its `__init__` re-exports them all.
CONFIG_LEVELS: dict[str, int] = {
    "base": 0, "legacy": 1,
    "model": 1, "roles": 1, "algorithm": 1, "run": 1, "rollout": 2,  # the sections
    "tree": 3, "rules": 4, "spec": 4, "root": 5, "sft": 6, "load": 7,  # spec: each worker's RoleSpec, from the tree
}


def test_config_modules_import_down():
    folder = PACKAGE / "config"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(CONFIG_LEVELS), "a config module without a level here"
    known = _module_names()
    upward = []
    for name, level in CONFIG_LEVELS.items():
        for line, target in _module_imports(f"rlcore.config.{name}", folder / f"{name}.py", known):
            if target.startswith("rlcore.config") and CONFIG_LEVELS.get(target.rpartition(".")[2], 99) >= level:
                upward.append(f"rlcore/config/{name}.py:{line} imports {target}")
    assert not upward, "imports against the config package's order:\n" + "\n".join(upward)
