"""The reward model's stages of the pipeline (`rlcore pipeline run --reward model`): train a reward
model on preference pairs (a config with `algorithm.name: rm`), evaluate it and the registered
champion reward model on the same held-out pairs, register it as its own MLflow model
(`registry.model_name` of its config) and move `champion` by the same promotion as a policy's
(`rlcore.lifecycle.promotion.promote_stage`), gated on pairwise accuracy. The policy is then
trained against the champion reward model, and its version's lineage names that reward-model
version (`stages.train_stage`'s `reward_model`).

Plain functions like `stages`; `rlcore.flows.rl_pipeline` runs them as Prefect tasks.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.config import Config
from rlcore.lifecycle.evaluation import evaluate_reward_model
from rlcore.lifecycle.fingerprint import files_fingerprint
from rlcore.lifecycle.pipeline_run import open_store, stage_tags
from rlcore.lifecycle.promotion import PAIRWISE_ACCURACY
from rlcore.lifecycle.results import Evaluation, PipelineContext, PreparedData, RegisteredVersion, RewardModelInUse, TrainResult
from rlcore.lifecycle.rm_plan import RewardModelStageError, champion_alias_uri, check_reward_model_config
from rlcore.lifecycle.stages import champion_stage, train_stage

CHANCE = {PAIRWISE_ACCURACY: 0.5}  # the baseline of a first reward model: it must beat coin flips by the margin


def reward_model_data(config: Config) -> PreparedData:
    """The reward model's preference files as the train stage reads them (logged as its datasets)
    and their content fingerprint."""
    files = list(config.data.train_files) + list(config.data.val_files)
    return {"train_file": config.data.train_files[0], "val_file": config.data.val_files[0],
            "fingerprint": files_fingerprint(files, extra={"algorithm": "rm"})}


def train_reward_model_stage(config: Config, workdir: str | Path, ctx: PipelineContext,
                             champion: RegisteredVersion | None = None) -> TrainResult:
    """Train the reward model (warm-started from the champion reward model when
    `registry.warm_start`); its candidate is the newest checkpoint's `reward_model/` folder."""
    return train_stage(config, reward_model_data(config), workdir, ctx, champion,
                       stage="train_reward_model", role="reward_model", keep_data=True)


def evaluate_reward_model_stage(config: Config, candidate_dir: str, champion: RegisteredVersion | None,
                                workdir: str | Path, ctx: PipelineContext | None = None) -> Evaluation:
    """The candidate and the champion reward model (or chance) on the same held-out pairs."""
    files = list(config.data.val_files)
    candidate = evaluate_reward_model(candidate_dir, files, config)
    baseline, name = (evaluate_reward_model(champion["path"], files, config), "champion") if champion else (dict(CHANCE), "chance")
    out: Evaluation = {"candidate": candidate, "baseline": baseline, "baseline_name": name, "candidate_dir": candidate_dir,
                       "held_out": files}
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("evaluate_reward_model", ctx["run_id"], {**stage_tags(ctx, "evaluate_reward_model"),
                                                                          "baseline": name})
        store.log_metrics(run_id, {**{f"candidate/{k}": v for k, v in candidate.items()},
                                   **{f"{name}/{k}": v for k, v in baseline.items()}})
        store.log_json(run_id, out, "evaluation.json")
        store.end_run(run_id)
        out["run_id"] = run_id
    return out


def reward_model_in_use(config: Config, workdir: str | Path) -> RewardModelInUse:
    """The champion reward model (downloaded): what the policy trains against, with the name,
    version and `models:/` uri its lineage records."""
    champion = champion_stage(config, workdir)
    if champion is None:
        raise RewardModelStageError(f"no champion version of the reward model {config.registry.model_name!r} to train "
                                    "the policy against: the first candidate was not promoted (see the "
                                    "promote_reward_model stage), or training it stopped before a checkpoint")
    name = config.registry.model_name
    return {"version": champion["version"], "path": champion["path"], "tags": champion["tags"], "name": name,
            "uri": f"models:/{name}/{champion['version']}"}


__all__ = [
    "CHANCE", "RewardModelStageError", "champion_alias_uri", "check_reward_model_config", "evaluate_reward_model_stage",
    "reward_model_data", "reward_model_in_use", "train_reward_model_stage",
]
