"""MLflow access for the lifecycle: runs (one per pipeline run, nested per stage), artifacts,
plots, datasets, and the model registry (versions, `champion` / `challenger` aliases, tags).
A version is an MLflow pyfunc model whose folder is also a plain HF folder (`hf_pyfunc`).

Everything goes through an explicit `MlflowClient` and run ids, never MLflow's thread-local
"active run", so stages may run in Prefect's worker threads. Default store: a SQLite file in
the working directory, artifacts next to it (`mlruns/`); any tracking server by URI.
"""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.redact import redact_params, redact_text
from rlcore.tracking import MlflowStore, flatten, read_jsonl
from rlcore.tracking import default_tracking_uri as default_tracking_uri  # re-exported for the stages

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"


def log_training(store: MlflowStore, run_id: str, run_dir: str | Path, config_tree: dict[str, Any]) -> list[dict[str, Any]]:
    """After a run: params from the resolved config, the config and JSONL files, and PNG plots;
    returns the step records of metrics.jsonl. Step metrics are not logged here: the training run
    logs them into the run live (`tracking.run_id`), step by step."""
    run_dir = Path(run_dir)
    store.log_params(run_id, flatten(config_tree))
    records = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
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

# What the y axis of each curve group measures (a plot without it reads as unitless numbers).
Y_LABELS = {
    "reward": "mean reward per response",
    "accuracy": "fraction answered correctly",
    "kl": "KL to the reference (per token)",
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
        fig = curve_figure(name, series)
        path = Path(out_dir) / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def curve_figure(name: str, series: dict[str, list[tuple[int, float]]]) -> Any:
    """The matplotlib figure of one curve group: a line per metric, step on x, `Y_LABELS` on y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel(Y_LABELS.get(name, name))
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------- datasets
def log_dataset(store: MlflowStore, run_id: str, path: str | Path, name: str, context: str,
                fingerprint: str | None = None, tags: dict[str, str] | None = None) -> None:
    """A data file as the run's MLflow dataset input (what `mlflow.log_input` records, by run id
    rather than the thread's active run): schema and row count from its rows, rlcore's content
    fingerprint of its rows (`rows_fingerprint`, computed when not given) as the digest, its
    first 32 hex digits (MLflow keeps at most 36), and in full as the input tag `rlcore.fingerprint`."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from rlcore.data.io import read_rows
    from rlcore.lifecycle.fingerprint import rows_fingerprint

    path = Path(path).resolve()
    rows = read_rows(path)
    fingerprint = fingerprint or rows_fingerprint(rows)
    with warnings.catch_warnings():  # MLflow registers the local source twice ("" and "file") and says so
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        source = resolve_dataset_source(str(path))
    dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name, digest=fingerprint[:32])
    input_tags = [InputTag(MLFLOW_DATASET_CONTEXT, context), InputTag("rlcore.fingerprint", fingerprint),
                  *(InputTag(k, str(v)) for k, v in (tags or {}).items())]
    store.client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=input_tags)])


# ---------------------------------------------------------------------- models
def log_model_folder(store: MlflowStore, run_id: str, hf_dir: str | Path, artifact_path: str = "model") -> None:
    """The HF folder `hf_dir` as the run's `artifact_path`, made an MLflow pyfunc model on the way
    (`MLmodel`, code, requirements next to the HF files; see rlcore.lifecycle.hf_pyfunc)."""
    from rlcore.lifecycle.hf_pyfunc import save_hf_pyfunc

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_pyfunc(hf_dir, Path(tmp) / artifact_path)
        store.log_artifact(run_id, folder, artifact_path)


# ---------------------------------------------------------------------- registry
@dataclass
class VersionInfo:
    name: str
    version: str
    source: str
    run_id: str | None
    tags: dict[str, str]
    aliases: list[str]
    description: str = ""


class ModelRegistry:
    """One registered model: versions from run artifact folders, aliases, tags, downloads."""

    def __init__(self, store: MlflowStore, name: str, description: str = "rlcore RL post-trained policies (causal LMs)") -> None:
        self.store = store
        self.client = store.client
        self.name = name
        self.description = description  # of the registered model, set when it is created

    def ensure(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description=self.description)

    def register(self, run_id: str, artifact_path: str = "model", tags: dict[str, str] | None = None,
                 description: str | None = None) -> VersionInfo:
        """A new version whose files are the run's `artifact_path` folder (HF safetensors; an
        MLflow model too when logged by `log_model_folder`)."""
        self.ensure()
        source = self.store.artifact_uri(run_id, artifact_path)
        mv = self.client.create_model_version(self.name, source=source, run_id=run_id, tags=redact_params(tags or {}),
                                              description=redact_text(description) if description else description)
        return self.get(mv.version)

    def get(self, version: str) -> VersionInfo:
        mv = self.client.get_model_version(self.name, str(version))
        return VersionInfo(self.name, str(mv.version), mv.source, mv.run_id, dict(mv.tags or {}),
                           list(getattr(mv, "aliases", []) or []), mv.description or "")

    def describe(self, version: str, description: str) -> None:
        """The version's description (shown on its page in the MLflow UI)."""
        self.client.update_model_version(self.name, str(version), description=redact_text(description))

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
        for k, v in redact_params(tags).items():  # no secrets in MLflow
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


__all__ = [
    "CHALLENGER", "CHAMPION", "CURVES", "MlflowStore", "ModelRegistry", "VersionInfo", "default_tracking_uri", "flatten",
    "log_dataset", "log_model_folder", "log_training", "plot_curves",
]
