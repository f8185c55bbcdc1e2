"""The run's own sections: the trainer loop, run health, the Ray cluster and its pools, MLflow
tracking and the registry's promotion gate."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from rlcore.algorithms import Role
from rlcore.config.base import Section, differs_from_default


class TrainerConfig(Section):
    total_steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: str = "runs/default"
    save_every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)
    val_every: int = Field(10, ge=1)
    val_before_train: bool = True
    resume: str = Field("auto", description="'auto' (newest complete checkpoint), 'disable', or a checkpoint path")
    loggers: list[Literal["console", "jsonl", "mlflow"]] = Field(
        ["console", "jsonl"], description="mlflow: one MLflow run per training run (tracking.mlflow_uri), kept across resumes"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["inprocess", "ray"] = Field("inprocess", description="where workers run: this process, or Ray actors")
    off_policy: Literal["sync", "one_step", "async"] = Field(
        "sync",
        description="one_step: generate step k+1's samples (with the weights before step k's update, staleness 1) "
        "while step k's update runs; async: a rollout thread generates without stopping into a bounded buffer of "
        "prompt groups, each step trains on the next groups at most trainer.max_staleness updates old (in process, "
        "or on Ray with the rollout on its own pool: rlcore.trainer.async_rollout); GRPO and PPO (not DPO/KTO: nothing to overlap)",
    )
    max_staleness: int = Field(
        1, ge=0, description="trainer.off_policy=async: actor updates a sample's generating weights may lag the "
        "weights it trains on (0: on-policy); older prompt groups are dropped and counted (async/dropped_groups)")
    async_chunk_prompts: int | None = Field(
        None, ge=1, description="trainer.off_policy=async: prompts per generate call (a step's batch is generated in "
        "chunks of this many); new weights reach the engine between two calls, so a weight sync waits for one "
        "chunk, not a whole batch. Default: the step's whole batch in one call")
    async_weight_sync: Literal["generation", "step"] = Field(
        "generation", description="trainer.off_policy=async: when new weights reach the engine. generation: between "
        "two generate calls (a sync waits for the call in flight); step: between two decode steps of the call in "
        "flight (rollout.backend=hf or vllm), which goes on with the new weights (its KV cache recomputed), each token "
        "recording its policy version (token_versions; a group's staleness is its oldest token's)")
    device_peak_tflops: float | None = Field(
        None, gt=0, description="dense peak TFLOP/s of one device at the compute dtype, for throughput/<phase>_mfu; "
        "default: detected for known NVIDIA GPUs (bf16 tensor-core peak, rlcore.flops), none on CPU (no MFU reported)")
    overlap_with: Literal["thread", "process"] = Field(
        "thread", description="trainer.backend=inprocess with trainer.off_policy=one_step: where the rollout worker runs "
        "while the actor trains. thread: a thread of this process (torch ops release the GIL; no start-up, no copies, a "
        "breakpoint in the rollout stops here); process: a child process (no GIL shared with the trainer; ~4 s to start, "
        "batches and weights pickled across). The cores are split between it and the training thread either way")
    trace: bool = Field(True, description="write trace.jsonl in the run dir: per step, phase timings, workers, and every "
                        "sample; and val_trace.jsonl: per validation, every validation sample")
    trace_samples: int = Field(4, ge=0, description="trajectories per step, and per validation, (evenly spread over the "
                               "batch) whose conversation trace.jsonl (val_trace.jsonl) records: the prompt, the model's text of every turn, "
                               "each tool call's arguments and result (the response, without an agent); `rlcore trace "
                               "RUN_DIR [--validation]` prints one. 0: none")
    trace_max_chars: int = Field(2000, ge=16, description="each text of a recorded conversation is cut to this many "
                                 "characters, after the secrets in it are redacted (rlcore.redact)")

    @model_validator(mode="after")
    def _check_max_staleness(self) -> TrainerConfig:
        """Read only by the async mode: set with another it would change nothing."""
        for key in ("max_staleness", "async_chunk_prompts", "async_weight_sync"):
            if self.off_policy != "async" and differs_from_default(self, key):
                raise ValueError(f"{key} is set, but trainer.off_policy={self.off_policy!r} does not read it "
                                 "(only trainer.off_policy=async)")
        return self

    @model_validator(mode="after")
    def _check_trace(self) -> TrainerConfig:
        """A trace setting is refused when trace.jsonl is off (it would change nothing); compared with
        the defaults, so a dumped config.yaml loads again."""
        if not self.trace:
            for key in ("trace_samples", "trace_max_chars"):
                if differs_from_default(self, key):
                    raise ValueError(f"{key} is set, but trainer.trace is off (no trace.jsonl is written)")
        return self


ROLES: tuple[Role, ...] = get_args(Role)


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RayPoolConfig(Section):
    """A placement group: one bundle per rank of the largest group placed on it. `strategy` spreads
    the bundles over nodes (STRICT_SPREAD: one node each); `resources` and `label_selector` say
    which nodes may hold them (every bundle alike)."""

    cpus_per_bundle: float = Field(1.0, ge=0)
    gpus_per_bundle: float = Field(0.0, ge=0)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    resources: dict[str, float] = Field(
        {}, description="custom resources each bundle reserves, e.g. {node_a: 1}: only nodes started with them "
        "(`ray start --resources '{\"node_a\": 2}'`) hold the pool")
    label_selector: dict[str, str] = Field(
        {}, description="node labels each bundle's node must match (Ray's label selectors: 'v', '!v', 'in(a,b)', "
        "'!in(a,b)'), e.g. {pool: train} for nodes started with `ray start --labels pool=train`")

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is set by cpus_per_bundle/gpus_per_bundle (or not per bundle), not here")
            if not amount > 0:
                raise ValueError(f"{name!r}: the amount must be > 0, got {amount}")
        return value

    @field_validator("label_selector")
    @classmethod
    def _valid_label_selector(cls, value: dict[str, str]) -> dict[str, str]:
        """Checked with Ray's own validator (imported only when a selector is given)."""
        if value:
            try:
                from ray._private.label_utils import validate_label_selector
            except ImportError:  # no Ray (or another layout): Ray checks it when the pool is made
                return value
            error = validate_label_selector(value)
            if error:
                raise ValueError(error)
        return value


class RayConfig(Section):
    """Where the Ray backend runs workers (trainer.backend=ray)."""

    address: str | None = Field(None, description="existing cluster ('auto', 'host:port' of its head's GCS); none: "
                                "$RAY_ADDRESS when set (as inside a Ray job), else start a local one")
    num_cpus: float | None = Field(None, gt=0, description="local cluster only; default: this machine's cores (Ray's "
                                   "count); more lets more ranks than cores run, sharing them")
    temp_dir: str | None = Field(None, description="local cluster's temp/session folder (keep it short: socket paths)")
    pools: dict[str, RayPoolConfig] = {"default": RayPoolConfig()}
    roles: dict[str, str] = Field({}, description="role -> pool name; roles not listed use the pool 'default'")
    colocate: list[list[str]] = Field([], description="roles sharing one process per rank, e.g. [[actor, ref]]")
    call_timeout_s: float | None = Field(3600.0, gt=0, description="longest a worker call may run before it is an error")
    init_timeout_s: float = Field(600.0, gt=0, description="longest worker start-up (import, model load, rendezvous)")

    @model_validator(mode="after")
    def _check_names(self) -> RayConfig:
        for role, pool in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"ray.roles: unknown role {role!r} (roles: {list(ROLES)})")
            if pool not in self.pools:
                raise ValueError(f"ray.roles.{role}: unknown pool {pool!r} (pools: {list(self.pools)})")
        seen: set[str] = set()
        for group in self.colocate:
            for role in group:
                if role not in ROLES:
                    raise ValueError(f"ray.colocate: unknown role {role!r} (roles: {list(ROLES)})")
                if role in seen:
                    raise ValueError(f"ray.colocate: role {role!r} is in two colocated sets")
                seen.add(role)
            if len({self.pool_of(r) for r in group}) > 1:
                raise ValueError(f"ray.colocate: {group} must map to one pool in ray.roles")
        return self

    def pool_of(self, role: str) -> str:
        return self.roles.get(role, "default")


class HealthConfig(Section):
    """Run-health limits checked after every training step of every run, `rlcore train` and the
    pipeline alike (None switches a check off; `enabled: false` all of them).

    `max_kl` reads `actor/kl` (present only when a reference model is used; nats per token, the
    same unit whatever the reward's scale), `min_entropy` reads `actor/entropy`. The jump checks
    scale with the run: `reward_jump_sigmas` stops a step whose `reward/mean` moved by more than
    that many times the spread of the last `jump_window` steps' rewards (every sample's reward in
    those steps together), `kl_jump_sigmas` the same for `actor/kl` (per-sequence KL); both are off
    for the first `jump_window` steps and while that spread is 0. `max_reward_jump` is an absolute
    limit on the reward's move, off by default (set it when the reward's scale is known).
    `max_param_norm_growth` compares the actor's parameter norm `actor/param_norm` of consecutive
    steps (and a non-finite weight or optimizer state always stops the run)."""

    enabled: bool = True
    max_kl: float | None = Field(1.0, gt=0, description="KL to the reference above this stops the run")
    min_entropy: float | None = Field(0.01, ge=0, description="policy entropy below this (collapse) stops the run")
    max_reward_jump: float | None = Field(None, gt=0, description="|reward/mean change| between consecutive steps above "
                                          "this stops the run (absolute, in the reward's units; off by default: "
                                          "reward_jump_sigmas scales with the run)")
    reward_jump_sigmas: float | None = Field(
        3.0, gt=0, description="reward/mean moving by more than this many times the spread of the last jump_window "
        "steps' rewards in one step stops the run (a reward exploit found, a collapse)")
    kl_jump_sigmas: float | None = Field(
        6.0, gt=0, description="actor/kl moving by more than this many times the spread of the last jump_window "
        "steps' per-sequence KL in one step stops the run (the policy lurching away)")
    jump_window: int = Field(5, ge=1, description="steps whose spread is the jump checks' baseline; the checks start "
                             "after this many steps")
    max_param_norm_growth: float | None = Field(
        2.0, gt=1, description="the actor's parameter norm growing by more than this factor in one step stops the run")


class TrackingConfig(Section):
    """Where runs are recorded (MLflow)."""

    mlflow_uri: str | None = Field(None, description="tracking URI; default: sqlite:///<working dir>/mlflow.db")
    experiment: str = "rlcore"
    log_model: bool = Field(True, description="log the final model folder as a run artifact")
    run_id: str | None = Field(None, description="with the mlflow logger: log each step into this existing MLflow "
                               "run, which its owner ends (the pipeline's train stage); default: a run per run folder")


class RegistryConfig(Section):
    """The MLflow registered model and the promotion gate (see rlcore.lifecycle.gate)."""

    model_name: str = "rlcore-tiny"
    metric: Literal["accuracy", "mean_reward", "pairwise_accuracy"] = Field(
        "accuracy", description="what the gate compares; pairwise_accuracy: a reward model's held-out preference accuracy")
    promotion_margin: float = Field(0.01, description="candidate must beat the champion by at least this (negative: may be slightly worse)")
    max_kl: float = Field(0.5, gt=0, description="KL budget: mean per-token KL of the candidate to the reference model")
    max_length_ratio: float = Field(1.5, gt=0, description="length budget: candidate mean response length / champion's")
    warm_start: bool = Field(True, description="train from the current champion when there is one")
    webhook_url: str | None = Field(None, description="POSTed a JSON summary on promotion, rejection, health stop and "
                                    "failure (pipeline and `rlcore train`), and when `rlcore train` finishes")

