"""MLflow access for the lifecycle: runs (one per pipeline run, nested per stage), artifacts,
plots, and the model registry (versions, `champion` / `challenger` aliases, tags).

Everything goes through an explicit `MlflowClient` and run ids, never MLflow's thread-local
"active run", so stages may run in Prefect's worker threads. Default store: a SQLite file in
the working directory, artifacts next to it (`mlruns/`); any tracking server by URI.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.tracking import MlflowSink, MlflowStore, flatten, read_jsonl
from rlcore.tracking import default_tracking_uri as default_tracking_uri  # re-exported for the stages

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"


def log_training(store: MlflowStore, run_id: str, run_dir: str | Path, config_tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Params from the resolved config, every step's metrics (from the run's metrics.jsonl,
    which is exactly the resumed run's record), the config and JSONL files, and PNG plots."""
    run_dir = Path(run_dir)
    store.log_params(run_id, flatten(config_tree))
    records = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    sink = MlflowSink(run_id, client=store.client)
    for rec in records:
        sink.log(int(rec["step"]), {k: v for k, v in rec.items() if k != "step"})
    for name in ("config.yaml", "metrics.jsonl"):
        if (run_dir / name).is_file():
            store.client.log_artifact(run_id, str(run_dir / name))
    with tempfile.TemporaryDirectory() as tmp:
        for png in plot_curves(records, Path(tmp)):
            store.client.log_artifact(run_id, str(png), "plots")
    return records


# ---------------------------------------------------------------------- plots
CURVES = {
    "reward": ("reward/mean", "val/reward"),
    "accuracy": ("acc/mean", "val/acc"),
    "kl": ("actor/kl", "actor/reward_kl_penalty"),
}


def plot_curves(records: list[dict[str, Any]], out_dir: Path, curves: dict[str, Iterable[str]] = CURVES) -> list[Path]:
    """One PNG per curve group that has data (`reward.png`, `accuracy.png`, `kl.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, keys in curves.items():
        series = {}
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if pts:
                series[key] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(out_dir) / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------------- registry
@dataclass
class VersionInfo:
    name: str
    version: str
    source: str
    run_id: str | None
    tags: dict[str, str]
    aliases: list[str]


class ModelRegistry:
    """One registered model: versions from run artifact folders, aliases, tags, downloads."""

    def __init__(self, store: MlflowStore, name: str) -> None:
        self.store = store
        self.client = store.client
        self.name = name

    def ensure(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="rlcore RL post-trained models")

    def register(self, run_id: str, artifact_path: str = "model", tags: dict[str, str] | None = None) -> VersionInfo:
        """A new version whose files are the run's `artifact_path` folder (HF safetensors)."""
        self.ensure()
        source = self.store.artifact_uri(run_id, artifact_path)
        mv = self.client.create_model_version(self.name, source=source, run_id=run_id, tags=tags or {})
        return self.get(mv.version)

    def get(self, version: str) -> VersionInfo:
        mv = self.client.get_model_version(self.name, str(version))
        return VersionInfo(self.name, str(mv.version), mv.source, mv.run_id, dict(mv.tags or {}), list(getattr(mv, "aliases", []) or []))

    def by_alias(self, alias: str) -> VersionInfo | None:
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException:
            return None
        return self.get(mv.version)

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def set_tags(self, version: str, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(self.name, str(version), k, str(v))

    def uri(self, alias_or_version: str) -> str:
        sep = "/" if str(alias_or_version).isdigit() else "@"
        return f"models:/{self.name}{sep}{alias_or_version}"

    def download(self, alias_or_version: str, dst: str | Path) -> Path:
        """The version's files in `dst` (an HF folder transformers and vLLM load as is)."""
        import mlflow

        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
        mlflow.set_tracking_uri(self.store.tracking_uri)
        mlflow.set_registry_uri(self.store.tracking_uri)
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=self.uri(alias_or_version), dst_path=str(dst))
        finally:
            mlflow.set_tracking_uri(previous[0])
            mlflow.set_registry_uri(previous[1])
        return Path(local)
