"""Run configuration: pydantic models, YAML files and dotted command-line overrides.

Every section forbids unknown keys, so a typo (`actor.optim.lrr=1e-6`) is an error that names
the key instead of a silently ignored setting. The package's modules, each one job:

- `base`: `ConfigError`, the section base, the algorithm registries' names, error formatting;
- the sections: `model` (model, data), `roles` (actor, critic, reference, reward, reward model and
  what they share: optimizer, LoRA, layout), `rollout`, `algorithm` (algorithm, KL control,
  preference), `run` (trainer, health, Ray, tracking, registry);
- `tree` (`ConfigTree`: an RL run's sections and what they determine together), `rules` (the
  cross-section rules as plain functions, `RULES` their order) and `root` (`Config`: the tree whose
  one validator runs the rules);
- `spec`: `RoleSpec`, what one worker is handed (its own section, the model's, its layout and the
  few named values of other sections), built once per role by `role_spec`;
- `sft`: `SFTConfig`, `rlcore sft`'s schema, its actor's `RoleSpec` (`sft_actor_spec`) and the RL
  `Config` its run parts read;
- `legacy`: older spellings of keys, rewritten on the raw tree before validation (a removal date
  on each);
- `load`: YAML, dotted overrides, `load_config` / `load_sft_config`, `dump_config`.

Import from here (`from rlcore.config import Config, load_config`); the modules are the layout.
"""

from rlcore.config.algorithm import AlgorithmConfig, KLControlConfig, PreferenceConfig
from rlcore.config.base import (
    MAX_PROBLEMS_SHOWN,
    ConfigError,
    check_registered,
    estimator_inputs,
    registered_names,
)
from rlcore.config.load import (
    WEBHOOK_ENV,
    config_from_dict,
    dump_config,
    load_config,
    load_sft_config,
    parse_override,
    set_key,
    sft_config_from_dict,
)
from rlcore.config.model import DataConfig, ModelConfig
from rlcore.config.roles import (
    MAX_RANKS,
    MICRO_BATCH_AUTO,
    ActorConfig,
    CriticConfig,
    LayoutConfig,
    LoraConfig,
    OptimConfig,
    Ranks,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    TokenBudget,
)
from rlcore.config.rollout import AgentConfig, RolloutConfig, VLLMEngineConfig
from rlcore.config.root import Config
from rlcore.config.run import (
    RAY_BUILTIN_RESOURCES,
    ROLES,
    HealthConfig,
    RayConfig,
    RayPoolConfig,
    RegistryConfig,
    TrackingConfig,
    TrainerConfig,
)
from rlcore.config.sft import (
    SFTActorConfig,
    SFTConfig,
    SFTDataConfig,
    SFTHealthConfig,
    SFTOptimConfig,
    SFTTrainerConfig,
    sft_actor_spec,
)
from rlcore.config.spec import LoraSync, MicroSpec, RoleSpec, require_spec, role_spec
from rlcore.config.tree import ConfigTree

__all__ = [
    "MAX_PROBLEMS_SHOWN", "MAX_RANKS", "MICRO_BATCH_AUTO", "RAY_BUILTIN_RESOURCES", "ROLES", "WEBHOOK_ENV",
    "ActorConfig", "AgentConfig", "AlgorithmConfig", "Config", "ConfigError", "ConfigTree", "CriticConfig",
    "DataConfig", "HealthConfig", "KLControlConfig", "LayoutConfig", "LoraConfig", "LoraSync", "MicroSpec", "ModelConfig",
    "OptimConfig", "RoleSpec",
    "PreferenceConfig", "Ranks", "RayConfig", "RayPoolConfig", "RefConfig", "RegistryConfig", "RewardConfig",
    "RewardModelConfig", "RolloutConfig", "SFTActorConfig", "SFTConfig", "SFTDataConfig", "SFTHealthConfig",
    "SFTOptimConfig", "SFTTrainerConfig", "TokenBudget", "TrackingConfig", "TrainerConfig", "VLLMEngineConfig",
    "check_registered", "config_from_dict", "dump_config", "estimator_inputs", "load_config", "load_sft_config",
    "parse_override", "registered_names", "require_spec", "role_spec", "set_key", "sft_config_from_dict", "sft_actor_spec",
]
