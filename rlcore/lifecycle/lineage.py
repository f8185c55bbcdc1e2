"""Lineage records: everything needed to say where a model version came from.

Recorded in full as `lineage.json` on the run of every registered model version: the dataset
fingerprint, the reward functions used with a version (a hash of their source), the registered
reward model version a policy was trained against (`reward_model`: name, version, `models:/` uri),
the resolved config, the code version (git commit, dirty flag), package versions and the parent
model; the version itself carries a few `rlcore.*` tags drawn from it (`lineage_tags`).
"""

from __future__ import annotations

import hashlib
import inspect
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("rlcore", "torch", "transformers", "tokenizers", "safetensors", "numpy", "prefect", "mlflow", "vllm", "ray")
REPO_ROOT = Path(__file__).resolve().parents[2]


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "rlcore":
                import rlcore

                out[name] = rlcore.__version__
    return out


def code_version(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Git commit of the checkout (and whether it has uncommitted changes), if it is one."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        import rlcore

        return {"commit": None, "dirty": None, "version": rlcore.__version__}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status), "version": None}


def _fn_record(fn: Any) -> dict[str, str]:
    module = inspect.getmodule(fn)
    try:
        source = inspect.getsource(module) if module is not None else inspect.getsource(fn)
    except (OSError, TypeError):
        source = repr(fn)
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    return {"name": name, "version": hashlib.sha256(source.encode()).hexdigest()[:12]}


def reward_functions(spec: str | None, data_sources: Iterable[str]) -> dict[str, dict[str, str]]:
    """data_source -> {"name", "version"} of the function that grades it (version: source hash)."""
    from rlcore.rewards import registry

    if spec is not None:
        record = _fn_record(registry.load_reward_fn(spec))
        return {ds: record for ds in sorted(set(data_sources))}
    builtin = getattr(registry, "_BUILTIN", {})
    return {ds: _fn_record(builtin.get(ds, registry.default_compute_score)) for ds in sorted(set(data_sources))}


def build_lineage(
    *,
    config: dict[str, Any],
    dataset_fingerprint: str,
    data_sources: Iterable[str],
    parent_model: str,
    reward_function: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The lineage record (JSON-serialisable) of one trained model."""
    return {
        "dataset_fingerprint": dataset_fingerprint,
        "reward_functions": reward_functions(reward_function, data_sources),
        "config": config,
        "code": code_version(),
        "packages": package_versions(),
        "parent_model": parent_model,
        **(extra or {}),
    }


def lineage_tags(lineage: dict[str, Any]) -> dict[str, str]:
    """A few namespaced tags for a registered model version, the ones people filter and compare
    versions by; everything else (config, packages, per-source reward versions) is in the
    version's run as `lineage.json`."""
    code = lineage.get("code", {})
    commit = code.get("commit")
    code_tag = f"{commit[:12]}{'-dirty' if code.get('dirty') else ''}" if commit else f"rlcore {code.get('version')}"
    rewards = sorted({f"{r['name']}@{r['version']}" for r in lineage.get("reward_functions", {}).values()})
    algorithm = lineage.get("config", {}).get("algorithm", {})
    tags = {
        "rlcore.parent_model": str(lineage.get("parent_model")),
        "rlcore.dataset_fingerprint": lineage["dataset_fingerprint"],
        "rlcore.algorithm": str(algorithm.get("name", "unknown")),
        "rlcore.reward": ",".join(rewards),
        "rlcore.code": code_tag,
    }
    if lineage.get("reward_model"):  # the registered reward model version a policy was trained against
        tags["rlcore.reward_model"] = str(lineage["reward_model"]["uri"])
    return tags
