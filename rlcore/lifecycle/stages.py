"""The pipeline's stages as plain functions: data prep -> [SFT warm start] -> train -> evaluate -> promote.

`rlcore.flows` wraps each in a Prefect task (retries, timeouts, caching) and composes them; here is
everything they do, testable without Prefect. Stages exchange JSON-able dicts (Prefect persists
task results) and record themselves as nested MLflow runs under the pipeline's run.

Reference model: the model the first generation was trained from (`config.model.path` as given)
is the fixed anchor that the KL budget is measured against, for candidate and champion alike,
so drift accumulates across warm-started generations instead of resetting each time.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

from rlcore.config import Config, LoraConfig, SFTConfig, config_from_dict, load_config, load_sft_config
from rlcore.lifecycle.data_prep import prepare_dataset
from rlcore.lifecycle.evaluation import evaluate_model
from rlcore.lifecycle.fingerprint import files_fingerprint
from rlcore.lifecycle.gate import GatePolicy, decide
from rlcore.lifecycle.health import HealthBreach
from rlcore.lifecycle.lineage import build_lineage, lineage_tags
from rlcore.lifecycle.mlflow_store import (
    CHALLENGER,
    CHAMPION,
    MlflowStore,
    ModelRegistry,
    log_dataset,
    log_model_folder,
    log_training,
)
from rlcore.lifecycle.notify import notify
from rlcore.redact import redact_tree
from rlcore.tracking import default_tracking_uri, flatten

log = logging.getLogger(__name__)

PIPELINE_TAG = "rlcore.pipeline_run"
STAGE_TAG = "rlcore.stage"


def new_run_name() -> str:
    return time.strftime("pipeline-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def load_pipeline_config(config_path: str | None, overrides: list[str] = (), data_path: str | None = None) -> Config:
    """The run's config; `data_path` (a newly arrived data file) replaces `data.train_files`."""
    overrides = list(overrides)
    if data_path:
        overrides.append(f"data.train_files=[{data_path}]")
    return load_config(config_path, overrides)


def tracking_uri(config: Config) -> str:
    """`tracking.mlflow_uri`, else $MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    return config.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def open_store(config: Config, workdir: str | Path) -> MlflowStore:
    uri = tracking_uri(config)
    return MlflowStore(uri, experiment=config.tracking.experiment)


def _with(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some fields of some sections replaced (validated again)."""
    tree = config.model_dump(mode="json")
    for section, values in sections.items():
        tree[section].update(values)
    return config_from_dict(tree)


# ---------------------------------------------------------------------- Prefect <-> MLflow
def prefect_flow_run() -> dict[str, str]:
    """The Prefect flow run this code runs in (`id`, `name`, and `url` when a Prefect UI is
    known, i.e. a server rather than the ephemeral API); empty outside a flow run."""
    try:
        from prefect.runtime import flow_run
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
    except ImportError:
        return {}
    if not flow_run.id:
        return {}
    found = {"id": str(flow_run.id), "name": str(flow_run.name)}
    if PREFECT_API_URL.value() and PREFECT_UI_URL.value():
        found["url"] = f"{PREFECT_UI_URL.value()}/flow-runs/flow-run/{flow_run.id}"
    return found


def stage_tags(ctx: dict[str, Any], stage: str) -> dict[str, str]:
    """Tags of every MLflow run of a pipeline run: its name, the stage, and the Prefect flow run
    behind it (`prefect.flow_run_id`, `_name`, `_url`) so each side leads to the other."""
    return {PIPELINE_TAG: ctx["run_name"], STAGE_TAG: stage,
            **{f"prefect.flow_run_{k}": v for k, v in prefect_flow_run().items()}}


def _mlflow_run_link(store: MlflowStore, run_id: str) -> str:
    """The run's page on a tracking server, or how to open the UI on a local store."""
    if store.tracking_uri.startswith(("http://", "https://")):
        return f"[MLflow run {run_id}]({store.tracking_uri.rstrip('/')}/#/experiments/{store.experiment_id}/runs/{run_id})"
    return f"MLflow run `{run_id}` (experiment `{store.experiment_id}`): `{store.run_url_hint()}`"


def _link_flow_run_to_mlflow(store: MlflowStore, run_id: str, run_name: str) -> None:
    """A markdown artifact on the current Prefect flow run naming its MLflow run; never fails
    the pipeline (a link is not worth a failed run)."""
    if not prefect_flow_run():
        return
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            markdown=f"# MLflow\n\nPipeline run `{run_name}`: {_mlflow_run_link(store, run_id)}\n\n"
                     f"Tracking URI: `{store.tracking_uri}`\n",
            key="mlflow-run", description=f"mlflow_run_id={run_id}")
    except Exception as err:  # noqa: BLE001
        log.warning("could not link the Prefect flow run to MLflow run %s: %s", run_id, err)


def _announce(message: str) -> None:
    """A lifecycle decision, printed once: by rlcore's logger when it is on (`rlcore -v`), else,
    inside a Prefect run, by the run's logger (the console of `pipeline run`/`pipeline serve`
    and the flow run's logs in the Prefect UI)."""
    log.info(message)
    if log.isEnabledFor(logging.INFO):
        return
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger
    except ImportError:
        return
    try:
        get_run_logger().info(message)
    except MissingContextError:
        pass


# ---------------------------------------------------------------------- pipeline run
def start_pipeline(config: Config, workdir: str | Path, run_name: str, trigger: dict[str, Any] | None = None) -> dict[str, Any]:
    store = open_store(config, workdir)
    ctx: dict[str, Any] = {"run_name": run_name}
    run_id = store.start_run(run_name, tags={**stage_tags(ctx, "pipeline"),
                                             **{f"trigger.{k}": str(v) for k, v in (trigger or {}).items()}})
    store.log_params(run_id, flatten(config.model_dump(mode="json")))
    _link_flow_run_to_mlflow(store, run_id, run_name)
    return {"run_id": run_id, "run_name": run_name, "tracking_uri": store.tracking_uri, "workdir": str(Path(workdir).resolve()),
            "prefect_flow_run_id": prefect_flow_run().get("id")}


def finish_pipeline(config: Config, ctx: dict[str, Any], summary: dict[str, Any], status: str = "FINISHED") -> None:
    store = open_store(config, ctx["workdir"])
    metrics = {k: summary[k] for k in ("accuracy_before", "accuracy_after") if isinstance(summary.get(k), (int, float))}
    store.log_metrics(ctx["run_id"], metrics)
    store.set_tags(ctx["run_id"], {f"summary.{k}": v for k, v in summary.items() if not isinstance(v, (dict, list))})
    store.log_json(ctx["run_id"], summary, "summary.json")
    store.end_run(ctx["run_id"], status)


def fail_pipeline(config: Config, ctx: dict[str, Any], error: BaseException, notify_webhook: bool = True) -> None:
    """Record the failure on the run and notify (unless `notify_webhook` is False: a server-side
    automation reports it, see rlcore.lifecycle.automations); never raises (the original error
    matters)."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    try:
        store = open_store(config, ctx["workdir"])
        store.set_tags(ctx["run_id"], {"failure": text[:4000]})
        store.end_run(ctx["run_id"], "FAILED")
    except Exception as err:  # noqa: BLE001
        log.warning("could not record the failure in MLflow: %s", err)
    if notify_webhook:
        notify(config.registry.webhook_url, "failed", {"pipeline_run": ctx.get("run_name"), "error": text})


# ---------------------------------------------------------------------- data prep
def data_prep_key(config: Config, val_fraction: float = 0.1) -> str:
    """Input fingerprint: the content of the input files and the prep settings."""
    return files_fingerprint(list(config.data.train_files) + list(config.data.val_files), extra={
        "n_train_files": len(config.data.train_files), "on_bad_row": config.data.on_bad_row,
        "val_fraction": val_fraction if not config.data.val_files else None, "seed": config.trainer.seed})


def prepare_data_stage(config: Config, workdir: str | Path, val_fraction: float = 0.1,
                       ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate, dedupe, split, write parquet under `workdir/data/<input fingerprint>`."""
    key = data_prep_key(config, val_fraction)
    prepared = prepare_dataset(
        config.data.train_files, Path(workdir) / "data" / key[:16], config.data.val_files,
        on_bad_row=config.data.on_bad_row, val_fraction=val_fraction, seed=config.trainer.seed,
    )
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("data_prep", ctx["run_id"], stage_tags(ctx, "data_prep"))
        store.log_params(run_id, {"input_fingerprint": key, "dataset_fingerprint": prepared.fingerprint,
                                  "train_file": prepared.train_file, "val_file": prepared.val_file})
        store.log_metrics(run_id, {f"rows/{k}": v for k, v in prepared.counts.items()})
        store.log_artifact(run_id, Path(prepared.train_file).parent / "prep_report.json")
        store.end_run(run_id)
        store.set_tags(ctx["run_id"], {"dataset_fingerprint": prepared.fingerprint})
    return {**prepared.to_dict(), "input_fingerprint": key}


# ---------------------------------------------------------------------- SFT warm start
def sft_stage_config(config: Config, sft: dict[str, Any], workdir: str | Path) -> SFTConfig:
    """The warm start's SFT config: `sft["config_path"]` (else the SFT defaults) from the RL
    config's `model.path`, on `sft["data_path"]` when given, then `sft["overrides"]`; its output
    folder is keyed by what decides the result (data content, settings, base model), so a later
    pipeline run on the same inputs reuses it, and its reference model stays the same."""
    overrides = [f"model.path={config.model.path}"]
    if sft.get("data_path"):
        overrides.append(f"data.train_files=[{sft['data_path']}]")
    overrides += list(sft.get("overrides") or [])
    first = load_sft_config(sft.get("config_path"), overrides)
    tree = first.model_dump(mode="json")
    tree["trainer"].pop("output_dir")
    tree.pop("tracking")
    key = files_fingerprint([*first.data.train_files, *first.data.val_files],
                            extra={"sft": tree, "base_model": str(Path(first.model.path).resolve())})
    return load_sft_config(sft.get("config_path"), [*overrides, f"trainer.output_dir={Path(workdir) / 'sft' / key[:16]}"])


def sft_stage(config: Config, sft: dict[str, Any], workdir: str | Path, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """Supervised warm start of the base model (`rlcore.trainer.sft`): the RL stages then start
    from its output, which is also the reference their KL is measured against. Done once per
    inputs (a finished output folder is reused); a retried stage resumes from its checkpoints."""
    from rlcore.trainer.sft import MODEL, run_sft_config

    sft_config = sft_stage_config(config, sft, workdir)
    out = Path(sft_config.trainer.output_dir)
    done = out / MODEL
    result: dict[str, Any] = {"model_dir": str(done.resolve()), "output_dir": str(out.resolve()),
                              "base_model": str(Path(config.model.path).resolve()), "cached": (done / "config.json").is_file()}
    if result["cached"]:
        _announce(f"SFT warm start: reusing {done} (same data, settings and base model)")
        return result
    run_id = None
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("sft", ctx["run_id"], {**stage_tags(ctx, "sft"), "base_model": result["base_model"]})
        loggers = list(sft_config.trainer.loggers) + ([] if "mlflow" in sft_config.trainer.loggers else ["mlflow"])
        # model_copy, not a dump and reload: a reload would see every default as set, and the SFT
        # config refuses RL-only keys that are set
        sft_config = sft_config.model_copy(update={
            "trainer": sft_config.trainer.model_copy(update={"loggers": loggers}),
            "tracking": sft_config.tracking.model_copy(update={"mlflow_uri": store.tracking_uri, "run_id": run_id})})
    try:
        model_dir, history = run_sft_config(sft_config)
    except BaseException as err:
        if run_id is not None:
            store.set_tags(run_id, {"failure": str(err)[:4000]})
            store.end_run(run_id, "FAILED")
        raise
    last = history[-1] if history else {}
    result.update(steps=last.get("step", 0), **{k.replace("/", "_"): v for k, v in last.items() if k.endswith("/loss")})
    if run_id is not None:
        store.set_tags(run_id, {"model_dir": result["model_dir"]})
        store.end_run(run_id)
        result["run_id"] = run_id
    return result


# ---------------------------------------------------------------------- champion
def champion_stage(config: Config, workdir: str | Path) -> dict[str, Any] | None:
    """The registry's current champion, downloaded (once per version) to a local folder."""
    store = open_store(config, workdir)
    registry = ModelRegistry(store, config.registry.model_name)
    found = registry.by_alias(CHAMPION)
    if found is None:
        return None
    local = Path(workdir) / "registry" / config.registry.model_name / f"v{found.version}"
    if not (local / "config.json").is_file():
        tmp = local.with_name(local.name + f".tmp-{secrets.token_hex(3)}")
        registry.download(found.version, tmp)
        tmp.rename(local)
    return {"version": found.version, "uri": registry.uri(CHAMPION), "path": str(local.resolve()), "tags": found.tags}


# ---------------------------------------------------------------------- train
def train_stage(config: Config, prepared: dict[str, Any], workdir: str | Path, ctx: dict[str, Any],
                champion: dict[str, Any] | None = None, reward_model: dict[str, Any] | None = None, *,
                stage: str = "train", role: str = "actor", keep_data: bool = False) -> dict[str, Any]:
    """Train from the config (warm-started from the champion when configured), under the health
    guard; resumes from the newest complete checkpoint of this pipeline run when retried.

    `reward_model` (the registered reward model version the policy is trained against: `path`,
    `name`, `version`, `uri`) becomes the run's `reward_model.path` and is named in its tags and
    result, so the policy version's lineage names it. `stage`, `role` and `keep_data` train
    another role the same way: the reward model (`train_reward_model_stage`) is stage
    `train_reward_model`, its candidate the checkpoint's `reward_model/` folder, its data the
    config's own preference files."""
    from rlcore.checkpoint import CheckpointManager
    from rlcore.trainer.run import run_training
    from rlcore.trainer.run_state import TrainingStopped
    from rlcore.workers.checkpointing import adapter_folder

    reference_model = str(Path(config.model.path).resolve())
    start_model, parent = reference_model, reference_model
    if champion is not None and config.registry.warm_start:
        start_model, parent = champion["path"], f"models:/{config.registry.model_name}/{champion['version']}"
    output_dir = Path(ctx["workdir"]) / ctx["run_name"] / stage
    store = open_store(config, workdir)
    rm_tags = {"reward_model": reward_model["uri"]} if reward_model else {}
    run_id = store.start_run(stage, ctx["run_id"], {**stage_tags(ctx, stage), "parent_model": parent,
                                                    "dataset_fingerprint": prepared["fingerprint"], **rm_tags})
    loggers = list(config.trainer.loggers) + ([] if "mlflow" in config.trainer.loggers else ["mlflow"])
    data = {} if keep_data else {"train_files": [prepared["train_file"]], "val_files": [prepared["val_file"]]}
    run_config = _with(
        config,
        model={"path": start_model},
        data=data,
        trainer={"output_dir": str(output_dir), "loggers": loggers},
        # each step goes live into this stage's run (no run of its own; a retry's run also gets
        # the steps it resumes after, from metrics.jsonl)
        tracking={"mlflow_uri": store.tracking_uri, "run_id": run_id},
        reward_model={"path": reward_model["path"]} if reward_model else {},
    )
    _log_datasets(store, run_id, prepared, {"train": "training", "val": "validation"})
    stopped: dict[str, Any] | None = None
    try:
        run_training(run_config)  # every recipe runs the health guard of `health:`
    except HealthBreach as breach:
        stopped = breach.to_dict()
    except TrainingStopped as err:
        stopped = {"metric": None, "reason": str(err), "check": "trainer"}
    except BaseException as err:
        store.set_tags(run_id, {"failure": str(err)[:4000]})
        log_training(store, run_id, output_dir, run_config.model_dump(mode="json"))
        store.end_run(run_id, "FAILED")
        raise
    records = log_training(store, run_id, output_dir, run_config.model_dump(mode="json"))
    checkpoint = CheckpointManager(output_dir / "checkpoints").latest()
    if checkpoint is None:
        candidate = None
    else:  # the trained policy or reward model (with LoRA: merged with its base)
        candidate = candidate_folder(run_config, checkpoint, output_dir, role)
    if candidate is not None and config.tracking.log_model:
        log_model_folder(store, run_id, candidate, "model")  # an MLflow model that is an HF folder too
        if _trained_lora(run_config, role).enabled:  # the small adapter beside the servable merged model
            store.log_artifact(run_id, checkpoint / adapter_folder(role), "adapter")
    if stopped is not None:
        store.set_tags(run_id, {"health.stopped": "true", "health.reason": stopped["reason"],
                                "health.candidate": str(checkpoint) if checkpoint else "none"})
        store.set_tags(ctx["run_id"], {"health.reason": stopped["reason"]})
        notify(config.registry.webhook_url, "health_stop", {
            "pipeline_run": ctx["run_name"], "reason": stopped["reason"], "health": stopped,
            "candidate_checkpoint": str(checkpoint) if checkpoint else None})
    store.end_run(run_id)
    val_key = "val/pairwise_acc" if role == "reward_model" else "val/acc"
    vals = [r for r in records if val_key in r]
    return {
        "run_id": run_id,
        "output_dir": str(output_dir),
        "candidate_dir": str(candidate) if candidate is not None else None,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "model_logged": candidate is not None and config.tracking.log_model,
        "stopped": stopped,
        "start_model": start_model,
        "parent_model": parent,
        "reference_model": reference_model,
        "steps": max((r["step"] for r in records), default=0),
        "train_val_acc_first": vals[0][val_key] if vals else None,
        "train_val_acc_last": vals[-1][val_key] if vals else None,
        "reward_model": {k: reward_model[k] for k in ("name", "version", "uri")} if reward_model else None,
        # for lineage.json and the model version's tags (and Prefect's stored task result): redacted
        "config": redact_tree(run_config.model_dump(mode="json")),
    }


def _trained_lora(config: Config, role: str) -> LoraConfig:
    """The LoRA section of the role a pipeline stage trains: the policy's `actor`, or `reward_model`."""
    return config.actor.lora if role == "actor" else config.reward_model.lora


def candidate_folder(config: Config, checkpoint: Path, output_dir: Path, role: str = "actor") -> Path:
    """The checkpoint's trained `role` (the policy's `actor`, or `reward_model`) as a plain HF
    folder, servable as is: its `role/` folder, or with the role's LoRA the base (`model.path`)
    merged with its adapter, written once under `output_dir/merged/`."""
    from rlcore.workers.checkpointing import adapter_folder
    from rlcore.workers.lora import merge_adapter
    from rlcore.workers.reward_model import merge_reward_model

    if not _trained_lora(config, role).enabled:
        return checkpoint / role
    merged = output_dir / "merged" / checkpoint.name
    if not (merged / "config.json").is_file():
        tmp = merged.with_name(f".tmp-{merged.name}-{secrets.token_hex(3)}")
        merge = merge_adapter if role == "actor" else merge_reward_model
        merge(config.model.path, checkpoint / adapter_folder(role), tmp)
        if merged.exists():
            shutil.rmtree(merged)
        tmp.rename(merged)
    return merged


def _log_datasets(store: MlflowStore, run_id: str, prepared: dict[str, Any], contexts: dict[str, str]) -> None:
    """The prepared splits as the run's MLflow datasets ({"train"|"val": context}); the digest is
    each split's content fingerprint (computed from the rows when data prep did not give it)."""
    for split, context in contexts.items():
        tags = {"rlcore.dataset_fingerprint": prepared["fingerprint"]} if prepared.get("fingerprint") else {}
        log_dataset(store, run_id, prepared[f"{split}_file"], split, context, prepared.get(f"{split}_fingerprint"), tags)


# ---------------------------------------------------------------------- evaluate
def evaluate_stage(config: Config, candidate_dir: str, baseline_dir: str, baseline_name: str, reference_dir: str,
                   val_file: str, workdir: str | Path, ctx: dict[str, Any] | None = None,
                   limit: int | None = None) -> dict[str, Any]:
    """Candidate and baseline (champion, or the base model when there is none) on the same data."""
    kwargs = dict(reference_dir=reference_dir, max_prompt_length=config.data.max_prompt_length,
                  max_new_tokens=config.rollout.max_new_tokens, batch_size=config.data.val_batch_size,
                  reward_function=config.reward.function, apply_chat_template=config.data.apply_chat_template, limit=limit,
                  agent=config.rollout.agent)
    candidate = evaluate_model(candidate_dir, val_file, **kwargs)
    baseline = evaluate_model(baseline_dir, val_file, **kwargs)
    out = {"candidate": candidate.metrics(), "baseline": baseline.metrics(), "baseline_name": baseline_name,
           "baseline_dir": baseline_dir, "candidate_dir": candidate_dir, "val_file": val_file}
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("evaluate", ctx["run_id"], {**stage_tags(ctx, "evaluate"), "baseline": baseline_name})
        _log_datasets(store, run_id, {"val_file": val_file}, {"val": "evaluation"})
        store.log_metrics(run_id, {**{f"candidate/{k}": v for k, v in out["candidate"].items()},
                                   **{f"{baseline_name}/{k}": v for k, v in out["baseline"].items()}})
        store.log_json(run_id, out, "evaluation.json")
        store.end_run(run_id)
        out["run_id"] = run_id
    return out


# ---------------------------------------------------------------------- promote
def _existing_version(registry: ModelRegistry, run_name: str) -> str | None:
    """A version this pipeline run already registered (a retried promote must not register twice)."""
    try:
        versions = registry.client.search_model_versions(f"name='{registry.name}'")
    except Exception:  # noqa: BLE001 - no registered model yet
        return None
    for mv in versions:
        if (mv.tags or {}).get(PIPELINE_TAG) == run_name:
            return str(mv.version)
    return None


def promote_stage(config: Config, train: dict[str, Any], evaluation: dict[str, Any], prepared: dict[str, Any],
                  workdir: str | Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """Register the candidate as a new version; `champion` if it passes the gate, else `challenger`."""
    policy = GatePolicy.from_config(config.registry)
    decision = decide(evaluation["candidate"], evaluation["baseline"], policy, evaluation["baseline_name"])
    if train.get("stopped"):
        # A health-stopped run may still be promoted on its last healthy checkpoint, but say so.
        decision_reason = f"{decision.reason} (training stopped early: {train['stopped']['reason']})"
    else:
        decision_reason = decision.reason
    store = open_store(config, workdir)
    registry = ModelRegistry(store, config.registry.model_name)
    data_sources = _data_sources(prepared["train_file"])
    lineage = build_lineage(config=train["config"], dataset_fingerprint=prepared["fingerprint"], data_sources=data_sources,
                            parent_model=train["parent_model"], reward_function=config.reward.function,
                            extra={"pipeline_run": ctx["run_name"], "reference_model": train["reference_model"],
                                   "evaluation": {"candidate": evaluation["candidate"], "baseline": evaluation["baseline"],
                                                  "baseline_name": evaluation["baseline_name"]},
                                   # the registered reward model version the policy was trained against
                                   **({"reward_model": train["reward_model"]} if train.get("reward_model") else {})})
    store.log_json(train["run_id"], lineage, "lineage.json")
    run_id = store.start_run("promote", ctx["run_id"], stage_tags(ctx, "promote"))
    store.log_json(run_id, lineage, "lineage.json")
    alias = CHAMPION if decision.promote else CHALLENGER
    decision_tags = {"rlcore.decision": "promoted" if decision.promote else "rejected", "rlcore.check": decision.check}
    description = version_description(policy.metric, evaluation, alias, decision_reason, lineage, train["run_id"])
    version = _existing_version(registry, ctx["run_name"])
    if version is None:
        tags = {**lineage_tags(lineage), PIPELINE_TAG: ctx["run_name"], **decision_tags}
        version = registry.register(train["run_id"], "model", tags=tags, description=description).version
    else:  # a retried promote: the version this pipeline run registered, decided again
        registry.set_tags(version, decision_tags)
        registry.describe(version, description)
    registry.set_alias(alias, version)
    store.set_tags(run_id, {"version": version, "alias": alias, "decision": decision.check, "reason": decision_reason})
    store.end_run(run_id)
    cand, base = evaluation["candidate"][policy.metric], evaluation["baseline"][policy.metric]
    _announce(f"{config.registry.model_name} version {version} "
              f"{'promoted to champion' if decision.promote else 'not promoted (challenger)'}: {policy.metric} "
              f"{cand:.4f} vs the {evaluation['baseline_name']}'s {base:.4f}: {decision_reason}")
    result = {"version": version, "alias": alias, "promoted": decision.promote, "reason": decision_reason,
              "check": decision.check, "model": config.registry.model_name, "uri": registry.uri(alias)}
    notify(config.registry.webhook_url, "promoted" if decision.promote else "rejected", {
        "pipeline_run": ctx["run_name"], **result, "evaluation": {k: evaluation[k] for k in ("candidate", "baseline", "baseline_name")},
        "dataset_fingerprint": prepared["fingerprint"]})
    return result


def version_description(metric: str, evaluation: dict[str, Any], alias: str, reason: str, lineage: dict[str, Any],
                        train_run_id: str) -> str:
    """A registered version's description (markdown, on its MLflow page): the metric against
    the baseline, the decision and why, and where it came from."""
    cand, base = evaluation["candidate"], evaluation["baseline"]
    name = evaluation["baseline_name"]
    verdict = "Promoted to **champion**" if alias == CHAMPION else "Not promoted: **challenger**"
    algorithm = lineage.get("config", {}).get("algorithm", {}).get("name", "?")
    return (f"{verdict}. {metric} {cand[metric]:.4f} vs the {name}'s {base[metric]:.4f} "
            f"({cand[metric] - base[metric]:+.4f}) on the same {int(cand.get('num_prompts', 0))} held-out prompts.\n\n"
            f"Why: {reason}.\n\n"
            f"Candidate: accuracy {cand['accuracy']:.4f}, mean reward {cand['mean_reward']:.4f}, KL to the reference "
            f"{cand['kl_to_reference']:.4g}, mean response length {cand['response_length']:.3g} tokens.\n\n"
            f"Trained with {algorithm} from `{lineage.get('parent_model')}` on dataset "
            f"`{str(lineage.get('dataset_fingerprint'))[:16]}`, pipeline run `{lineage.get('pipeline_run')}`; the full "
            f"lineage is `lineage.json` of MLflow run `{train_run_id}`.")


def _no_promotion_reason(train: dict[str, Any]) -> str:
    if not train.get("candidate_dir"):
        return "no candidate: " + (train["stopped"]["reason"] if train.get("stopped") else "no complete checkpoint")
    return "not registered: the model was not logged (tracking.log_model=false)"


def _prefect_ui_hint() -> str:
    """How to see this run's flow runs: a server on the database the ephemeral server used."""
    from rlcore.lifecycle.prefect_db import DB_URL_VAR

    db_url = os.environ.get(DB_URL_VAR)
    if db_url:
        return f"{DB_URL_VAR}={db_url} prefect server start  (UI at http://127.0.0.1:4200)"
    try:
        from prefect.settings import get_current_settings

        home = str(get_current_settings().home)
    except Exception:  # noqa: BLE001 - only a hint
        home = "$PREFECT_HOME (~/.prefect)"
    return f"prefect server start  (UI at http://127.0.0.1:4200; flow runs are stored under {home})"


def _data_sources(train_file: str) -> list[str]:
    from rlcore.data.io import read_rows

    return sorted({str(r.get("data_source")) for r in read_rows(train_file)})


def summarize(ctx: dict[str, Any], prepared: dict[str, Any], train: dict[str, Any], evaluation: dict[str, Any] | None,
              promotion: dict[str, Any] | None, champion: dict[str, Any] | None, workdir: str | Path) -> dict[str, Any]:
    """What a person wants to know after a run, and where to look for more."""
    summary: dict[str, Any] = {
        "pipeline_run": ctx["run_name"],
        "dataset_fingerprint": prepared["fingerprint"],
        "warm_start": train["parent_model"] if champion is not None and train["start_model"] != train["reference_model"] else None,
        "steps": train["steps"],
        "health_stop": train["stopped"]["reason"] if train.get("stopped") else None,
        "baseline": evaluation["baseline_name"] if evaluation else None,
        "accuracy_before": evaluation["baseline"]["accuracy"] if evaluation else None,
        "accuracy_after": evaluation["candidate"]["accuracy"] if evaluation else None,
        "kl_to_reference": evaluation["candidate"]["kl_to_reference"] if evaluation else None,
        "version": promotion["version"] if promotion else None,
        "champion": promotion["promoted"] if promotion else False,
        "reason": promotion["reason"] if promotion else _no_promotion_reason(train),
        "model_uri": promotion["uri"] if promotion else None,
        "run_dir": train["output_dir"],
        "mlflow_run_id": ctx["run_id"],
        "prefect_flow_run_id": ctx.get("prefect_flow_run_id"),
        "mlflow_ui": f"mlflow ui --backend-store-uri {ctx['tracking_uri']}",
        "prefect_ui": _prefect_ui_hint(),
    }
    return summary


__all__ = [
    "PIPELINE_TAG", "STAGE_TAG", "champion_stage", "data_prep_key", "evaluate_stage", "fail_pipeline", "finish_pipeline",
    "load_pipeline_config", "new_run_name", "open_store", "prefect_flow_run", "prepare_data_stage", "promote_stage",
    "sft_stage", "sft_stage_config", "stage_tags", "start_pipeline", "summarize", "train_stage", "version_description",
]
