"""The rules that read more than one section, as plain functions of the whole config: each refuses
a combination the run cannot honour with a `ValueError` naming the keys. `RULES` is their order;
`rlcore.config.root.Config` runs them, in that order, after every section has validated. The
checks of one role's sections (`check_ranks_on_backend`, `check_mesh`, ...) take those sections
alone: `rlcore sft`'s config runs them on its actor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlcore.algorithms import names_where, traits_of
from rlcore.config.base import differs_from_default, estimator_inputs
from rlcore.config.model import ModelConfig
from rlcore.config.roles import ActorConfig, LayoutConfig, LoraConfig, RewardModelConfig
from rlcore.config.run import RayConfig
from rlcore.config.tree import ConfigTree
from rlcore.rollout_backends import names_where as backend_names_where
from rlcore.rollout_backends import support_problem
from rlcore.rollout_backends import traits_of as backend_traits_of


def check_preference(config: ConfigTree) -> None:
    """The reference model where the algorithm or a KL term needs it; preference keys the algorithm does not read."""
    if config.traits.reference == "always" and config.algorithm.use_reference is False:
        raise ValueError(f"algorithm.use_reference=false: {config.algorithm.name} needs the reference model")
    kl_terms = [k for k, on in (("actor.use_kl_loss", config.actor.use_kl_loss),
                                ("algorithm.use_kl_in_reward", config.algorithm.use_kl_in_reward)) if on]
    if config.algorithm.use_reference is False and kl_terms:
        raise ValueError(f"algorithm.use_reference=false, but {' and '.join(kl_terms)} need the reference model")
    unread = [k for k in type(config.preference).model_fields
              if k not in config.traits.preference_keys and differs_from_default(config.preference, k)]
    if unread:
        readers = [n for n in names_where() if unread[0] in traits_of(n).preference_keys]
        raise ValueError(f"preference.{unread[0]}: algorithm.name={config.traits.name} does not read it"
                         + (f" (a setting of {' and '.join(readers)})" if readers else ""))
    if config.preference.loss_type == "ipo" and config.preference.label_smoothing:
        raise ValueError("preference.label_smoothing applies to loss_type sigmoid or robust, not ipo")


def check_consistency(config: ConfigTree) -> None:
    """Batch sizes that divide; an estimator that matches the critic; several ranks only on Ray; a pool for every role."""
    traits, rm_batch = config.traits, config.reward_model.mini_batch_size
    if "reward_model" in traits.trains and rm_batch is not None and config.data.train_batch_size % rm_batch:
        raise ValueError(f"data.train_batch_size ({config.data.train_batch_size}) must be a multiple of "
                         f"reward_model.mini_batch_size ({rm_batch})")
    if traits.trains_policy and config.data.train_batch_size % config.actor.ppo_mini_batch_size:
        raise ValueError(
            f"data.train_batch_size ({config.data.train_batch_size}) must be a multiple of "
            f"actor.ppo_mini_batch_size ({config.actor.ppo_mini_batch_size})"
        )
    estimator = config.algorithm.adv_estimator
    reads_values = "values" in estimator_inputs(estimator)
    if traits.generates and traits.critic and not reads_values:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} reads no values: algorithm.name={traits.name} trains "
                         f"a critic for an estimator that does (gae)")
    if traits.generates and not traits.critic and reads_values:
        raise ValueError(f"algorithm.adv_estimator {estimator!r} needs a critic: use algorithm.name="
                         f"{' or '.join(names_where(generates=True, critic=True))}")
    for key in ("actor", "critic", "rollout", "reward_model"):
        check_ranks_on_backend(key, getattr(config, key), config.trainer.backend)
    check_default_pool(config.present_roles, config.ray, config.trainer.backend)


def check_ranks_on_backend(role: str, section: Any, backend: str) -> None:
    """Several ranks of a role section only on Ray."""
    if backend == "inprocess" and section.world_size > 1:
        what = f"{role}.layout ({section.layout.describe()})" if section.layout else f"{role}.world_size={section.world_size}"
        raise ValueError(f"{what} needs trainer.backend=ray (the in-process backend runs one rank)")


def check_default_pool(roles: Sequence[str], ray: RayConfig, backend: str) -> None:
    """On Ray, a pool for every role of the run (`roles`): those `ray.roles` leaves out need pool 'default'."""
    if backend == "ray" and "default" not in ray.pools:
        unmapped = [r for r in roles if r not in ray.roles]
        if unmapped:
            raise ValueError(f"ray.pools: roles {unmapped} use pool 'default', which is not defined")


def check_agent(config: ConfigTree) -> None:
    """Agent rollouts only for an algorithm that generates."""
    if config.rollout.agent.enabled and not config.traits.generates:
        raise ValueError(f"rollout.agent: the {config.algorithm.name!r} control flow generates nothing (agent rollouts "
                         f"need algorithm.name {' or '.join(names_where(generates=True))})")


def check_off_policy(config: ConfigTree) -> None:
    """One-step off-policy only where there is generation to overlap, and without a sleeping engine."""
    if config.trainer.off_policy != "sync" and not config.traits.generates:
        raise ValueError(f"trainer.off_policy={config.trainer.off_policy!r} is not supported by the "
                         f"{config.algorithm.name!r} control flow (no generation to overlap); use trainer.off_policy=sync")
    mode = config.trainer.off_policy
    if mode != "sync" and config.rollout.sleep == "always":
        raise ValueError(f"rollout.sleep=always with trainer.off_policy={mode}: the engine generates the "
                         "next batch while the actor trains, so it cannot sleep then (each sleep would wait for that "
                         "generation and undo the overlap); unset one of them")
    if mode == "async":
        check_async(config)
    else:
        check_overlap_with(config)


def check_overlap_with(config: ConfigTree) -> None:
    """`trainer.overlap_with` places the in-process rollout worker of a one_step run; where it would
    place nothing it is refused rather than ignored (async refuses `process` itself)."""
    t = config.trainer
    if t.overlap_with == "thread":  # the default
        return
    if t.off_policy == "sync":
        raise ValueError(f"trainer.overlap_with={t.overlap_with} with trainer.off_policy=sync: nothing generates beside "
                         "the update, so there is no rollout worker to place; set trainer.off_policy=one_step or unset "
                         "trainer.overlap_with")
    if t.backend == "ray":
        raise ValueError(f"trainer.overlap_with={t.overlap_with} with trainer.backend=ray: the rollout workers are Ray "
                         "processes of their own already (placed by ray.roles); unset trainer.overlap_with")


def check_async(config: ConfigTree) -> None:
    """What the async rollout cannot run, refused rather than run wrongly."""
    if config.trainer.backend == "ray":
        check_async_on_ray(config)
    if config.trainer.overlap_with != "thread":
        raise ValueError("trainer.overlap_with=process with trainer.off_policy=async: the async rollout's producer is a "
                         "thread of the trainer's process (on Ray it sends the generate calls to the rollout workers); "
                         "use trainer.overlap_with=thread")
    if "reward_baselines" in estimator_inputs(config.algorithm.adv_estimator):
        raise ValueError(f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} with trainer.off_policy=async: "
                         "its greedy baseline is generated for the step's own prompts, which the async rollout "
                         "chose earlier; use trainer.off_policy=sync or one_step")
    if config.trainer.async_weight_sync == "step":
        backend = config.rollout.backend  # `auto` is resolved at start-up, where `set_weight_switch` refuses it
        if backend != "auto" and not backend_traits_of(backend).decode_step_weights:
            takes = " or ".join(backend_names_where(decode_step_weights=True))
            raise ValueError(f"trainer.async_weight_sync=step with rollout.backend={backend}: only the {takes} engine "
                             f"takes new weights between decode steps; use rollout.backend={takes} or "
                             "trainer.async_weight_sync=generation")
        if config.rollout.agent.enabled:
            raise ValueError("trainer.async_weight_sync=step with rollout.agent: agent turns take new weights between "
                             "turns only; use trainer.async_weight_sync=generation")
        if config.rollout.lora_sync == "adapter":
            raise ValueError("trainer.async_weight_sync=step with rollout.lora_sync=adapter: the requests in flight run "
                             "with the adapter they started with, which a new one replaces; use rollout.lora_sync=merged "
                             "or trainer.async_weight_sync=generation")


def check_async_on_ray(config: ConfigTree) -> None:
    """On Ray the producer thread calls the rollout group remotely: its engine must be free to generate
    while the other roles compute (no process shared with them, no GPU shared with a model it cannot
    sleep for), and a weight sync reaches it between generate calls only."""
    ray = config.ray
    shared = next((group for group in ray.colocate if "rollout" in group), [])
    others = [r for r in shared if r != "rollout" and r in config.present_roles]  # colocated in this run
    if others:
        raise ValueError(f"ray.colocate: {shared} with trainer.off_policy=async: the rollout generates without "
                         f"stopping in that process, so every call of {' and '.join(others)} would wait for the "
                         "generation in flight (nothing overlaps); take rollout out of the colocated set")
    pool = ray.pool_of("rollout")
    on_its_gpus = [r for r in config.trained_roles if ray.pool_of(r) == pool]
    if on_its_gpus and pool in ray.pools and ray.pools[pool].gpus_per_bundle > 0:
        key = f"ray.roles.rollout={pool}" + ("" if "rollout" in ray.roles else " (unset: the default pool)")
        raise ValueError(f"{key} with trainer.off_policy=async: pool {pool!r} has GPUs and also "
                         f"holds {' and '.join(on_its_gpus)}; the engine would stay awake on their GPUs (async cannot "
                         "sleep it: it generates while they compute); give the rollout a pool of its own in ray.roles")
    if config.trainer.async_weight_sync == "step":
        raise ValueError("trainer.async_weight_sync=step with trainer.backend=ray: a sync is handed to the "
                         "generation in flight through this process's engine gate, which a Ray worker cannot "
                         "reach; use trainer.async_weight_sync=generation (or trainer.backend=inprocess)")


def check_validation_sampling(config: ConfigTree) -> None:
    """Greedy validation with one sample per prompt (n greedy samples are one answer)."""
    if config.rollout.val_greedy and config.rollout.val_n > 1:
        raise ValueError(f"rollout.val_greedy=true with rollout.val_n={config.rollout.val_n}: every sample would be the "
                         "same greedy answer (pass@n = accuracy); set rollout.val_greedy=false or val_n=1")


def check_sequence_parallel(config: ConfigTree) -> None:
    """Sequence-parallel sizes that divide their role's ranks, on packed rows."""
    roles = [("actor", config.actor.ulysses_sequence_parallel_size)]
    if config.traits.critic:
        roles.append(("critic", config.critic_sequence_parallel_size))
    for role, sp in roles:
        default = " (default: the actor's)" if role == "critic" and config.critic.ulysses_sequence_parallel_size is None else ""
        check_sequence_parallel_size(role, getattr(config, role), sp, default)
    for role in config.trained_roles:
        check_packed_sequence_parallel(config.layout_key(role, "sequence_parallel"), config.layout_of(role).sequence_parallel,
                                       config.model)


def check_sequence_parallel_size(role: str, section: Any, sp: int, default: str = "") -> None:
    """A role section's sequence-parallel size `sp` divides its ranks (`default`: a note on where `sp` came from)."""
    key = f"{role}.layout.sequence_parallel" if section.layout is not None else f"{role}.ulysses_sequence_parallel_size"
    if section.world_size % sp:
        raise ValueError(f"{key}={sp}{default} does not divide {role}.world_size={section.world_size}: each sequence-parallel "
                         f"group is {sp} of the {role}'s ranks")


def check_packed_sequence_parallel(key: str, sp: int, model: ModelConfig) -> None:
    """Sequence parallelism (`key`=`sp`) only on packed rows."""
    if sp > 1 and not model.use_remove_padding:
        raise ValueError(f"{key}={sp} needs model.use_remove_padding=true: "
                         "sequence parallelism splits the packed row of a micro-batch along its tokens")


def check_layouts(config: ConfigTree) -> None:
    """Layouts only on roles the run has; no tensor parallelism with LoRA; several ranks only on Ray."""
    """Layouts of roles this run does not have are refused (they would be ignored); tensor
    parallelism with LoRA is refused; several ranks need the Ray backend."""
    roles = set(config.present_roles)
    for role in ("critic", "reward_model", "ref"):
        if getattr(config, role).layout is not None and role not in roles:
            raise ValueError(f"{role}.layout is set, but this run has no {role} worker group")
    if config.ref.layout is not None and config.actor.lora.enabled:
        raise ValueError("ref.layout is set, but with actor.lora the reference is the actor's own base (its adapter "
                         "disabled), on the actor's ranks and layout")
    for role in config.trained_roles:
        lora = {"actor": config.actor.lora, "critic": config.critic.lora, "reward_model": config.reward_model.lora}.get(role)
        check_mesh(role, config.layout_of(role), config.layout_key(role, "tensor_parallel"), lora, config.trainer.backend)


def check_mesh(role: str, layout: LayoutConfig, tp_key: str, lora: LoraConfig | None, backend: str) -> None:
    """No tensor parallelism (`tp_key`) with the role's LoRA; a mesh of several ranks only on Ray."""
    tp = layout.tensor_parallel
    if tp > 1 and lora is not None and lora.enabled:
        raise ValueError(f"{tp_key}={tp} with {role}.lora: peft's adapter "
                         "layers wrap the very linear layers tensor parallelism splits, so rlcore does not "
                         "combine them; train a LoRA adapter data-parallel (FSDP2 shards the frozen base)")
    if backend == "inprocess" and layout.world_size > 1:
        raise ValueError(f"{role}.layout: {layout.describe()} needs trainer.backend=ray (the "
                         "in-process backend runs one rank)")


def check_cpu_offload(config: ConfigTree) -> None:
    """CPU offload only with a CUDA device."""
    check_actor_offload(config.actor, config.trainer.device)


def check_actor_offload(actor: ActorConfig, device: str) -> None:
    """The actor's CPU offload only with a CUDA device."""
    if actor.cpu_offload and device == "cpu":
        raise ValueError("actor.cpu_offload=true needs a CUDA device: with trainer.device=cpu the weights, gradients "
                         "and optimizer state already live in host memory, so there is nothing to offload")


def check_liger_kernel(config: ConfigTree) -> None:
    """Liger's kernels only with a CUDA device."""
    check_actor_kernels(config.actor, config.trainer.device)


def check_actor_kernels(actor: ActorConfig, device: str) -> None:
    """The actor's Liger kernels only with a CUDA device."""
    if actor.liger_kernel and device == "cpu":
        raise ValueError("actor.liger_kernel=true needs a CUDA device: Liger's kernels are Triton GPU kernels "
                         "(trainer.device=cpu)")


def check_lora_sync(config: ConfigTree) -> None:
    """`rollout.lora_sync` only with LoRA on the actor, and the adapter itself only to vLLM."""
    sync = config.rollout.lora_sync
    if sync != "auto" and not config.actor.lora.enabled:
        raise ValueError(f"rollout.lora_sync={sync} needs LoRA on the actor (actor.lora.rank > 0)")
    problem = None if config.rollout.backend == "auto" else support_problem(config.rollout.backend, 1, sync)
    if problem is not None:  # auto: the rollout worker checks what it resolves to
        raise ValueError(problem)


def check_lora_roles(config: ConfigTree) -> None:
    """LoRA set on a role this run does not train is refused: it would be ignored."""
    name, traits = config.algorithm.name, config.traits
    if not traits.trains_policy and config.actor.lora != LoraConfig():
        raise ValueError(f"actor.lora: algorithm.name={name} trains a reward model, not the policy; LoRA on it is "
                         "reward_model.lora")
    if not traits.critic and config.critic.lora != LoraConfig():
        raise ValueError(f"critic.lora: algorithm.name={name} has no critic "
                         f"({' and '.join(names_where(critic=True))} has one)")


def check_reward_model(config: ConfigTree) -> None:
    """Reward-model settings only where they are read: scoring (reward_model.path) or training one (algorithm.name=rm)."""
    rm, name, traits = config.reward_model, config.algorithm.name, config.traits
    defaults = RewardModelConfig()
    set_keys = {k for k in (*rm.SCORING_KEYS, *rm.TRAINING_KEYS) if getattr(rm, k) != getattr(defaults, k)}
    trains_rm = "reward_model" in traits.trains
    if not trains_rm and config.registry.metric == "pairwise_accuracy":
        raise ValueError("registry.metric=pairwise_accuracy gates reward models (algorithm.name=rm); a policy is "
                         "gated on accuracy or mean_reward")
    if trains_rm:
        if rm.path is not None:
            raise ValueError("reward_model.path is the reward model an RL run scores with; algorithm.name=rm trains "
                             "a new one from model.path (unset reward_model.path)")
        ignored = [k for k in rm.SCORING_KEYS if k in set_keys]
        if ignored:
            raise ValueError(f"reward_model.{ignored[0]} applies to RL runs scoring with a reward model, not to "
                             "algorithm.name=rm (training one)")
        if config.registry.metric == "mean_reward":
            raise ValueError("registry.metric=mean_reward: a reward model is gated on its held-out pairwise accuracy "
                             "(registry.metric=pairwise_accuracy; accuracy means the same for algorithm.name=rm)")
        return
    ignored = [k for k in rm.TRAINING_KEYS if k in set_keys]
    if ignored:
        raise ValueError(f"reward_model.{ignored[0]} applies to training a reward model (algorithm.name=rm), "
                         f"not to algorithm.name={name}")
    if rm.path is None:
        ignored = [k for k in rm.SCORING_KEYS if k in set_keys]
        if ignored:
            raise ValueError(f"reward_model.{ignored[0]} is set but reward_model.path is not: no reward model "
                             "scores this run")
        return
    if not traits.reward:
        raise ValueError(f"reward_model.path: algorithm.name={name} learns from offline preference rows and "
                         f"generates nothing to score; a reward model scores {' and '.join(names_where(reward=True))} runs")
    if rm.weight == 0 and rm.rule_weight == 0:
        raise ValueError("reward_model.weight and reward_model.rule_weight are both 0: every reward would be 0")
    if "reward_baselines" in estimator_inputs(config.algorithm.adv_estimator):
        raise ValueError(f"reward_model.path with algorithm.adv_estimator={config.algorithm.adv_estimator}: ReMax's "
                         "greedy baseline is scored by the rule scorer alone, not by the reward model")


RULES: tuple[Callable[[ConfigTree], None], ...] = (
    check_preference, check_consistency, check_agent, check_off_policy, check_validation_sampling,
    check_sequence_parallel, check_layouts, check_cpu_offload, check_liger_kernel, check_lora_sync, check_lora_roles,
    check_reward_model,
)
