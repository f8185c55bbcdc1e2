"""MLflow access for the lifecycle: runs (one per pipeline run, nested per stage), artifacts,
plots, and the model registry (versions, `champion` / `challenger` aliases, tags).

Everything goes through an explicit `MlflowClient` and run ids, never MLflow's thread-local
"active run", so stages may run in Prefect's worker threads. Default store: a SQLite file in
the working directory, artifacts next to it (`mlruns/`); any tracking server by URI.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from rlcore.tracking import MlflowSink, mlflow_key, read_jsonl

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"


def default_tracking_uri(workdir: str | Path | None = None) -> str:
    return f"sqlite:///{(Path(workdir) if workdir else Path.cwd()).resolve() / 'mlflow.db'}"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"actor": {"optim": {"lr": 1e-6}}} -> {"actor.optim.lr": "1e-06"} (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return out


class MlflowStore:
    """Runs and artifacts in one experiment of one tracking store."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "rlcore", artifact_root: str | Path | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self._mlflow = mlflow
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            location = None
            if artifact_root is not None:
                location = Path(artifact_root).resolve().as_uri()
            elif self.tracking_uri.startswith("sqlite:///"):
                # Artifacts next to the database, not wherever the process happens to run.
                location = (Path(self.tracking_uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)

    # ------------------------------------------------------------------ runs
    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(k), str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow's limit of params per batch
            self.client.log_batch(run_id, params=items[start:start + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int = 0) -> None:
        MlflowSink(run_id, client=self.client).log(step, metrics)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_json(self, run_id: str, obj: Any, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / name
            p.write_text(json.dumps(obj, indent=1, default=str))
            self.client.log_artifact(run_id, str(p))

    def artifact_uri(self, run_id: str, path: str = "") -> str:
        base = self.client.get_run(run_id).info.artifact_uri
        return f"{base}/{path}" if path else base

    def run_url_hint(self) -> str:
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def log_training(self, run_id: str, run_dir: str | Path, config_tree: dict[str, Any]) -> list[dict[str, Any]]:
        """Params from the resolved config, every step's metrics (from the run's metrics.jsonl,
        which is exactly the resumed run's record), the config and JSONL files, and PNG plots."""
        run_dir = Path(run_dir)
        self.log_params(run_id, flatten(config_tree))
        records = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        sink = MlflowSink(run_id, client=self.client)
        for rec in records:
            sink.log(int(rec["step"]), {k: v for k, v in rec.items() if k != "step"})
        for name in ("config.yaml", "metrics.jsonl"):
            if (run_dir / name).is_file():
                self.client.log_artifact(run_id, str(run_dir / name))
        with tempfile.TemporaryDirectory() as tmp:
            for png in plot_curves(records, Path(tmp)):
                self.client.log_artifact(run_id, str(png), "plots")
        return records


# ---------------------------------------------------------------------- plots
CURVES = {
    "reward": ("reward/mean", "val/reward"),
    "accuracy": ("acc/mean", "val/acc"),
    "kl": ("actor/kl", "critic/kl_in_reward"),
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
