"""What the pipeline's stages hand each other, typed: each stage returns one of these and the next
reads its fields by name, checked by mypy instead of found missing at run time.

TypedDicts rather than dataclasses: at run time each is a plain dict of JSON values, so a Prefect
task's parameters and (persisted, JSON-serialised) results stay what they were, and a stored
result from an earlier run reads back as the same type.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

# typing_extensions' TypedDict: Prefect builds pydantic schemas from flow parameters, and pydantic
# takes only this one on Python < 3.12.
from typing_extensions import TypedDict

# Which role a train stage trained: the policy (`actor`) or a reward model.
Role = Literal["actor", "reward_model"]


class PipelineContext(TypedDict):
    """One pipeline run: its MLflow run (every stage's run nests under it) and where it works."""

    run_id: str
    run_name: str
    tracking_uri: str
    experiment_id: str
    workdir: str
    prefect_flow_run_id: str | None


class PreparedData(TypedDict):
    """The data a train stage reads: data prep's output (`PreparedData.to_dict` plus the input
    fingerprint), or a config's files as given (the `train` flow, a reward model's pairs)."""

    train_file: str
    val_file: str
    fingerprint: str  # content hash of the train and val rows
    train_fingerprint: NotRequired[str]
    val_fingerprint: NotRequired[str]
    counts: NotRequired[dict[str, int]]
    bad_rows: NotRequired[list[str]]
    input_fingerprint: NotRequired[str]  # of the input files and prep settings (data prep's cache key)


class SftResult(TypedDict):
    """The supervised warm start: the model folder RL starts from (and measures KL against)."""

    model_dir: str
    output_dir: str
    base_model: str
    cached: bool  # a finished folder from an earlier run on the same inputs
    steps: NotRequired[int]
    losses: NotRequired[dict[str, float]]  # the last step's `*/loss` metrics
    run_id: NotRequired[str]


class RegisteredVersion(TypedDict):
    """A registered model version downloaded to a local folder (the champion)."""

    version: str
    uri: str
    path: str
    tags: dict[str, str]


class RewardModelInUse(RegisteredVersion):
    """The reward-model version a policy trains against (`uri`: `models:/name/version`)."""

    name: str


class RewardModelRef(TypedDict):
    """How a policy's result, lineage and tags name the reward model it was trained against."""

    name: str
    version: str
    uri: str


class TrainResult(TypedDict):
    run_id: str
    role: Role
    output_dir: str
    candidate_dir: str | None  # None: no complete checkpoint (stopped before the first)
    checkpoint: str | None
    model_logged: bool
    stopped: dict[str, Any] | None  # `HealthBreach.to_dict()`, or {"reason", "check": "trainer", ...}
    start_model: str  # the folder training started from (the base, or the champion's when warm-started)
    parent_model: str  # the same as lineage names it: a folder, or `models:/name/version`
    reference_model: str
    steps: int
    train_val_acc_first: float | None
    train_val_acc_last: float | None
    reward_model: RewardModelRef | None
    data: PreparedData  # what it trained on (the lineage's dataset)
    config: dict[str, Any]  # the resolved run config, secrets redacted


class Evaluation(TypedDict):
    """A candidate and its baseline on the same held-out data, metric name -> value.

    Policy: `EvalResult.metrics()` (accuracy, mean reward, KL, length; `reward_model_score` when
    trained against a reward model), against the champion or the base model; `start` is the model
    training started from when that is not the baseline (the RLHF demo's before -> after).
    Reward model: pairwise accuracy, loss and score gap (`held_out_pair_metrics`), against the
    champion reward model or chance."""

    candidate: dict[str, float]
    baseline: dict[str, float]
    baseline_name: str  # "champion", "base" or "chance"
    candidate_dir: str
    held_out: list[str]  # the held-out data files
    start: NotRequired[dict[str, float]]
    run_id: NotRequired[str]


class Promotion(TypedDict):
    """What the promote stage decided for a newly registered version."""

    model: str  # the registered model's name
    version: str
    alias: str  # "champion" or "challenger"
    promoted: bool
    reason: str
    check: str  # the gate's deciding check: "promoted", "margin", "kl_budget", "length_budget"
    metric: str
    candidate_score: float
    baseline_score: float
    uri: str  # `models:/name@alias`
    version_uri: str  # `models:/name/version`


class Summary(TypedDict, total=False):
    """What `rlcore pipeline run` prints (and returns as JSON): the outcome and where to look."""

    pipeline_run: str
    dataset_fingerprint: str
    warm_start: str | None  # the champion training started from (`models:/name/version`), else None
    warm_start_accuracy: float | None  # its accuracy (the baseline's) before this run
    steps: int
    health_stop: str | None
    baseline: str | None
    accuracy_start: float | None  # of the model training started from, when that is not the baseline
    accuracy_before: float | None  # of the gate's baseline (the champion, else the base model)
    accuracy_after: float | None
    reward_model_score_start: float | None  # mean score of greedy answers by the reward model trained against
    reward_model_score_after: float | None
    kl_to_reference: float | None
    version: str | None
    champion: bool
    reason: str
    model_uri: str | None
    run_dir: str
    mlflow_run_id: str
    prefect_flow_run_id: str | None
    links: dict[str, str]  # mlflow_run, model_version, prefect_flow_run: pages in the UIs
    mlflow_ui: str
    prefect_ui: str
    sft_model: str
    reward_model: str | None
    reward_model_version: str | None
    reward_model_champion: bool
    reward_model_pairwise_accuracy: float | None
    reward_model_reason: str | None


__all__ = [
    "Evaluation", "PipelineContext", "PreparedData", "Promotion", "RegisteredVersion", "RewardModelInUse", "RewardModelRef",
    "Role", "SftResult", "Summary", "TrainResult",
]
