"""Lineage records: everything needed to say where a model version came from.

Recorded in full as `lineage.json` on the run of every registered model version: the dataset
fingerprint, the reward functions used with a version (a hash of their source), what a policy's
reward was (`reward`: the registered reward model version it was trained against and its weight,
the rule scorers and theirs; `reward_model`: that version's name, version, `models:/` uri), the
resolved config, the code version (git commit, dirty flag), package versions and the parent model;
the version itself carries a few `rlcore.*` tags drawn from it (`lineage_tags` for a policy,
`reward_model_tags` for a reward model).
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


def reward_record(config: dict[str, Any], reward_functions: dict[str, dict[str, str]],
                  reward_model: dict[str, str] | None) -> dict[str, Any]:
    """What a policy's reward was: `reward_model` (the registered version it was trained against,
    with its weight) and `rule` (the rule scorers by data source, with theirs: 1 without a reward
    model, `reward_model.rule_weight` with one; they judge accuracy either way)."""
    rm = config.get("reward_model", {})
    return {
        "reward_model": {**reward_model, "weight": rm.get("weight", 1.0)} if reward_model else None,
        "rule": {"weight": rm.get("rule_weight", 0.0) if reward_model else 1.0, "functions": reward_functions},
    }


def reward_tag(reward: dict[str, Any]) -> str:
    """The reward in one line: "models:/rm/1", "models:/rm/1 + 0.5 x compute_score@abc", "compute_score@abc"."""
    rules = sorted({f"{r['name']}@{r['version']}" for r in reward["rule"]["functions"].values()})
    parts = []
    if reward["reward_model"]:
        weight = float(reward["reward_model"]["weight"])
        parts.append(reward["reward_model"]["uri"] if weight == 1.0 else f"{weight:g} x {reward['reward_model']['uri']}")
        if float(reward["rule"]["weight"]) > 0:
            parts.append(f"{float(reward['rule']['weight']):g} x {','.join(rules)}")
        return " + ".join(parts)
    return ",".join(rules)


def _code_tag(lineage: dict[str, Any]) -> str:
    code = lineage.get("code", {})
    commit = code.get("commit")
    return f"{commit[:12]}{'-dirty' if code.get('dirty') else ''}" if commit else f"rlcore {code.get('version')}"


def lineage_tags(lineage: dict[str, Any]) -> dict[str, str]:
    """A few namespaced tags for a policy's registered version, the ones people filter and compare
    versions by; everything else (config, packages, per-source reward versions) is in the
    version's run as `lineage.json`. `rlcore.reward` is what the policy optimised: the reward
    model version (and the rule scorers when they weigh in), else the rule scorers."""
    algorithm = lineage.get("config", {}).get("algorithm", {})
    reward = lineage.get("reward") or reward_record(lineage.get("config", {}), lineage.get("reward_functions", {}),
                                                    lineage.get("reward_model"))
    tags = {
        "rlcore.kind": "policy",
        "rlcore.parent_model": str(lineage.get("parent_model")),
        "rlcore.dataset_fingerprint": lineage["dataset_fingerprint"],
        "rlcore.algorithm": str(algorithm.get("name", "unknown")),
        "rlcore.reward": reward_tag(reward),
        "rlcore.code": _code_tag(lineage),
    }
    if lineage.get("reward_model"):  # the registered reward model version a policy was trained against
        tags["rlcore.reward_model"] = str(lineage["reward_model"]["uri"])
    return tags


def reward_model_tags(lineage: dict[str, Any]) -> dict[str, str]:
    """A reward model version's tags: what it is, what it was trained from and on, and how it did
    on held-out pairs (a reward model has no reward of its own)."""
    candidate = lineage.get("evaluation", {}).get("candidate", {})
    tags = {
        "rlcore.kind": "reward_model",
        "rlcore.parent_model": str(lineage.get("parent_model")),
        "rlcore.preference_data": lineage["dataset_fingerprint"],
        "rlcore.algorithm": str(lineage.get("config", {}).get("algorithm", {}).get("name", "rm")),
        "rlcore.code": _code_tag(lineage),
    }
    if "pairwise_accuracy" in candidate:
        tags["rlcore.pairwise_accuracy"] = f"{candidate['pairwise_accuracy']:.4f}"
    return tags
