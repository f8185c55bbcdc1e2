"""The pipeline's stages as plain functions: data prep -> [SFT warm start] -> train -> evaluate -> promote.

`rlcore.flows` wraps each in a Prefect task (retries, timeouts, caching) and composes them; here is
everything they do, testable without Prefect. Stages exchange the typed dicts of
`rlcore.lifecycle.results` (plain JSON at run time: Prefect persists task results) and record
themselves as nested MLflow runs under the pipeline's run (`rlcore.lifecycle.pipeline_run`: the
run's context, its MLflow run and its links to Prefect). Promotion, for policies and reward
models alike, is `rlcore.lifecycle.promotion`.

Reference model: the model the first generation was trained from (`config.model.path` as given)
is the fixed anchor that the KL budget is measured against, for candidate and champion alike,
so drift accumulates across warm-started generations instead of resetting each time.
"""

from __future__ import annotations

import os
import secrets
import shutil
from functools import partial
from pathlib import Path
from typing import Any

from rlcore.config import Config, LoraConfig, SFTConfig, config_from_dict, load_sft_config, role_spec
from rlcore.lifecycle.data_prep import prepare_dataset
from rlcore.lifecycle.evaluation import evaluate_model
from rlcore.lifecycle.fingerprint import files_fingerprint
from rlcore.lifecycle.health import HealthBreach
from rlcore.lifecycle.mlflow_store import (
    CHAMPION,
    MlflowStore,
    ModelRegistry,
    log_dataset,
    log_model_folder,
    log_training,
)
from rlcore.lifecycle.notify import notify
from rlcore.lifecycle.pipeline_run import (
    announce,
    mlflow_run_url,
    model_version_url,
    notification_fields,
    open_store,
    prefect_flow_run_url,
    prefect_ui_hint,
    stage_tags,
)
from rlcore.lifecycle.results import (
    Evaluation,
    PipelineContext,
    PreparedData,
    Promotion,
    RegisteredVersion,
    RewardModelInUse,
    Role,
    SftResult,
    Summary,
    TrainResult,
)
from rlcore.redact import redact_tree
from rlcore.tracking import mlflow_ui_hint


def _with(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some fields of some sections replaced (validated again)."""
    tree = config.model_dump(mode="json")
    for section, values in sections.items():
        tree[section].update(values)
    return config_from_dict(tree)


# ---------------------------------------------------------------------- data prep
def data_prep_key(config: Config, val_fraction: float = 0.1) -> str:
    """Input fingerprint: the content of the input files and the prep settings."""
    return files_fingerprint(list(config.data.train_files) + list(config.data.val_files), extra={
        "n_train_files": len(config.data.train_files), "on_bad_row": config.data.on_bad_row,
        "val_fraction": val_fraction if not config.data.val_files else None, "seed": config.trainer.seed})


def prepare_data_stage(config: Config, workdir: str | Path, val_fraction: float = 0.1,
                       ctx: PipelineContext | None = None) -> PreparedData:
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
    return {"train_file": prepared.train_file, "val_file": prepared.val_file, "fingerprint": prepared.fingerprint,
            "train_fingerprint": prepared.train_fingerprint, "val_fingerprint": prepared.val_fingerprint,
            "counts": prepared.counts, "bad_rows": prepared.bad_rows, "input_fingerprint": key}


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


def sft_stage(config: Config, sft: dict[str, Any], workdir: str | Path, ctx: PipelineContext | None = None) -> SftResult:
    """Supervised warm start of the base model (`rlcore.trainer.sft`): the RL stages then start
    from its output, which is also the reference their KL is measured against. Done once per
    inputs (a finished output folder is reused); a retried stage resumes from its checkpoints."""
    from rlcore.trainer.sft import MODEL, run_sft_config

    sft_config = sft_stage_config(config, sft, workdir)
    out = Path(sft_config.trainer.output_dir)
    done = out / MODEL
    result: SftResult = {"model_dir": str(done.resolve()), "output_dir": str(out.resolve()),
                         "base_model": str(Path(config.model.path).resolve()), "cached": (done / "config.json").is_file()}
    if result["cached"]:
        announce(f"SFT warm start: reusing {done} (same data, settings and base model)")
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
    except Exception as err:  # an interrupt (a signal) leaves it open: run_end's hook ends it KILLED, with the reason
        if run_id is not None:
            store.set_tags(run_id, {"failure": str(err)[:4000]})
            store.end_run(run_id, "FAILED")
        raise
    last = history[-1] if history else {}
    result["steps"] = int(last.get("step", 0))
    result["losses"] = {k: float(v) for k, v in last.items() if k.endswith("/loss")}
    if run_id is not None:
        store.set_tags(run_id, {"model_dir": result["model_dir"]})
        store.end_run(run_id)
        result["run_id"] = run_id
    return result


# ---------------------------------------------------------------------- champion
def champion_stage(config: Config, workdir: str | Path) -> RegisteredVersion | None:
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
def train_stage(config: Config, prepared: PreparedData, workdir: str | Path, ctx: PipelineContext,
                champion: RegisteredVersion | None = None, reward_model: RewardModelInUse | None = None, *,
                stage: str = "train", role: Role = "actor", keep_data: bool = False) -> TrainResult:
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
    except Exception as err:  # an interrupt (a signal) leaves it open: run_end's hook ends it KILLED, with the reason
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
        if checkpoint is not None and _trained_lora(run_config, role).enabled:  # the adapter beside the merged model
            store.log_artifact(run_id, checkpoint / adapter_folder(role), "adapter")
    if stopped is not None:
        store.set_tags(run_id, {"health.stopped": "true", "health.reason": stopped["reason"],
                                "health.candidate": str(checkpoint) if checkpoint else "none"})
        store.set_tags(ctx["run_id"], {"health.reason": stopped["reason"]})
        notify(config.registry.webhook_url, "health_stop", {
            **notification_fields(ctx, "health_stop", stage), "reason": stopped["reason"], "health": stopped,
            "candidate_checkpoint": str(checkpoint) if checkpoint else None})
    store.end_run(run_id)
    val_key = "val/pairwise_acc" if role == "reward_model" else "val/acc"
    vals = [r for r in records if val_key in r]
    return {
        "run_id": run_id,
        "role": role,
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
        "reward_model": {"name": reward_model["name"], "version": reward_model["version"], "uri": reward_model["uri"]}
        if reward_model else None,
        "data": prepared,
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


def _log_datasets(store: MlflowStore, run_id: str, prepared: PreparedData | dict[str, Any], contexts: dict[str, str]) -> None:
    """The prepared splits as the run's MLflow datasets ({"train"|"val": context}); the digest is
    each split's content fingerprint (computed from the rows when data prep did not give it)."""
    for split, context in contexts.items():
        record: dict[str, Any] = dict(prepared)
        tags = {"rlcore.dataset_fingerprint": record["fingerprint"]} if record.get("fingerprint") else {}
        log_dataset(store, run_id, record[f"{split}_file"], split, context, record.get(f"{split}_fingerprint"), tags)


# ---------------------------------------------------------------------- evaluate
def evaluate_stage(config: Config, candidate_dir: str, baseline_dir: str, baseline_name: str, reference_dir: str,
                   val_file: str, workdir: str | Path, ctx: PipelineContext | None = None,
                   limit: int | None = None, start_dir: str | None = None,
                   reward_model_dir: str | None = None) -> Evaluation:
    """Candidate and baseline (champion, or the base model when there is none) on the same data;
    also the model training started from (`start_dir`) when that is not the baseline (a policy
    trained from the base while a champion exists). With `reward_model_dir` (the reward model the
    policy was trained against), each model's greedy answers are scored by it too
    (`reward_model_score`): what RLHF optimised, beside the rule-judged accuracy."""
    import torch

    from rlcore.workers.reward_model import open_reward_model

    reader = (open_reward_model(reward_model_dir, key="reward_model.path", spec=role_spec(config, "reward_model"),
                                 device=torch.device("cpu"))
              if reward_model_dir else None)
    evaluate = partial(evaluate_model, val_file=val_file, reference_dir=reference_dir,
                       max_prompt_length=config.data.max_prompt_length, max_new_tokens=config.rollout.max_new_tokens,
                       batch_size=config.data.val_batch_size, reward_function=config.reward.function,
                       apply_chat_template=config.data.apply_chat_template, limit=limit, agent=config.rollout.agent,
                       reward_model=reader)
    candidate = evaluate(candidate_dir)
    baseline = evaluate(baseline_dir)
    out: Evaluation = {"candidate": candidate.metrics(), "baseline": baseline.metrics(), "baseline_name": baseline_name,
                       "candidate_dir": candidate_dir, "held_out": [val_file]}
    if start_dir is not None and Path(start_dir).resolve() != Path(baseline_dir).resolve():
        out["start"] = evaluate(start_dir).metrics()
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("evaluate", ctx["run_id"], {**stage_tags(ctx, "evaluate"), "baseline": baseline_name})
        _log_datasets(store, run_id, {"val_file": val_file}, {"val": "evaluation"})
        store.log_metrics(run_id, {**{f"candidate/{k}": v for k, v in out["candidate"].items()},
                                   **{f"{baseline_name}/{k}": v for k, v in out["baseline"].items()},
                                   **{f"start/{k}": v for k, v in out.get("start", {}).items()}})
        store.log_json(run_id, out, "evaluation.json")
        store.end_run(run_id)
        out["run_id"] = run_id
    return out


# ---------------------------------------------------------------------- summary
def _no_promotion_reason(train: TrainResult) -> str:
    if not train["candidate_dir"]:
        return "no candidate: " + (train["stopped"]["reason"] if train["stopped"] else "no complete checkpoint")
    return "not registered: the model was not logged (tracking.log_model=false)"


def _prefect_ui_hint() -> str:
    """Where to see this run's flow runs: the Prefect server in use, or a server started here on the
    database the ephemeral API used."""
    from rlcore.lifecycle.prefect_db import DB_URL_VAR

    try:
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings

        api_url, ui_url, home = PREFECT_API_URL.value(), PREFECT_UI_URL.value(), str(get_current_settings().home)
    except Exception:  # noqa: BLE001 - only a hint
        api_url, ui_url, home = None, None, "$PREFECT_HOME (~/.prefect)"
    return prefect_ui_hint(api_url, ui_url, home, os.environ.get(DB_URL_VAR))


def summarize(ctx: PipelineContext, prepared: PreparedData, train: TrainResult, evaluation: Evaluation | None,
              promotion: Promotion | None, champion: RegisteredVersion | None, workdir: str | Path) -> Summary:
    """What a person wants to know after a run, and where to look for more."""
    warm = champion is not None and train["start_model"] != train["reference_model"]
    # the model training started from: the baseline itself, or (a champion exists but training
    # started from the base or SFT model) evaluated on its own
    start = (evaluation.get("start") or evaluation["baseline"]) if evaluation else None
    summary: Summary = {
        "pipeline_run": ctx["run_name"],
        "dataset_fingerprint": prepared["fingerprint"],
        "warm_start": train["parent_model"] if warm else None,
        "warm_start_accuracy": evaluation["baseline"]["accuracy"] if warm and evaluation else None,
        "steps": train["steps"],
        "health_stop": train["stopped"]["reason"] if train["stopped"] else None,
        "baseline": evaluation["baseline_name"] if evaluation else None,
        "accuracy_start": evaluation["start"]["accuracy"] if evaluation and "start" in evaluation else None,
        "accuracy_before": evaluation["baseline"]["accuracy"] if evaluation else None,
        "accuracy_after": evaluation["candidate"]["accuracy"] if evaluation else None,
        "kl_to_reference": evaluation["candidate"]["kl_to_reference"] if evaluation else None,
        "version": promotion["version"] if promotion else None,
        "champion": promotion["promoted"] if promotion else False,
        "reason": promotion["reason"] if promotion else _no_promotion_reason(train),
        "model_uri": promotion["uri"] if promotion else None,
        "run_dir": train["output_dir"],
        "mlflow_run_id": ctx["run_id"],
        "prefect_flow_run_id": ctx["prefect_flow_run_id"],
        "links": {"mlflow_run": mlflow_run_url(ctx["tracking_uri"], ctx["experiment_id"], ctx["run_id"])},
        "mlflow_ui": mlflow_ui_hint(ctx["tracking_uri"], ctx["experiment_id"]),
        "prefect_ui": _prefect_ui_hint(),
    }
    if promotion:
        summary["links"]["model_version"] = model_version_url(ctx["tracking_uri"], promotion["model"], promotion["version"])
    if ctx["prefect_flow_run_id"]:
        summary["links"]["prefect_flow_run"] = prefect_flow_run_url(ctx["prefect_flow_run_id"])
    if train["reward_model"] and evaluation and "reward_model_score" in evaluation["candidate"]:
        summary["reward_model_score_start"] = start.get("reward_model_score") if start else None
        summary["reward_model_score_after"] = evaluation["candidate"]["reward_model_score"]
    return summary


__all__ = [
    "champion_stage", "data_prep_key", "evaluate_stage", "prepare_data_stage", "sft_stage",
    "sft_stage_config", "summarize", "train_stage",
]
