"""Each worker is handed its role (`rlcore.config.RoleSpec`): its own section, the model's, its
layout and a few named values of other sections; never the whole config (one handed a config
refuses it). SFT builds its actor's spec from its own config, the one an RL config of the same
sections gives, and makes no RL config at all."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import rlcore
from rlcore.cli import CONFIG_DIR, main
from rlcore.config import (
    Config,
    ConfigTree,
    DataConfig,
    SFTConfig,
    TrainerConfig,
    load_config,
    load_sft_config,
    role_spec,
    sft_actor_spec,
)
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward import RewardWorker
from rlcore.workers.reward_model import RewardModelWorker
from rlcore.workers.rollout import RolloutWorker

BASE = ["model.path=m", "data.train_files=[t]", "trainer.device=cpu"]
WORKERS = {"actor": ActorWorker, "ref": ReferenceWorker, "critic": CriticWorker, "rollout": RolloutWorker,
           "reward": RewardWorker, "reward_model": RewardModelWorker}


@pytest.mark.parametrize("role", sorted(WORKERS))
def test_a_worker_holds_its_own_section_and_no_config(role):
    config = load_config(None, [*BASE, "algorithm.name=ppo", "algorithm.adv_estimator=gae", "reward_model.path=rm", "algorithm.use_reference=true"])
    worker = WORKERS[role](role_spec(config, role))
    assert not [k for k, v in vars(worker).items() if isinstance(v, ConfigTree)]
    assert worker.spec.section is getattr(config, role)
    assert worker.spec.layout == (config.layout_of(role) if role != "reward" else worker.spec.layout)


def test_another_roles_section_changes_a_spec_only_through_its_named_values():
    """The actor's spec is the same whatever the critic, reward or reward model sections say; the
    rollout's temperature reaches it as its log-prob temperature, the actor's LoRA rank reaches the
    rollout as the rank its engine serves."""
    base = load_config(None, BASE)
    others = load_config(None, [*BASE, "critic.optim.lr=0.5", "critic.micro_batch_size=3", "reward.num_workers=3",
                                "reward_model.max_length=64", "rollout.top_p=0.5"])
    assert role_spec(others, "actor") == role_spec(base, "actor")
    hot = role_spec(load_config(None, [*BASE, "rollout.temperature=0.7"]), "actor")
    assert hot.logprob_temperature == 0.7 and dataclasses.replace(hot, logprob_temperature=1.0) == role_spec(base, "actor")
    assert role_spec(load_config(None, [*BASE, "actor.lora.rank=8"]), "rollout").lora_rank == 8
    critic = role_spec(load_config(None, [*BASE, "actor.micro_batch_size=5"]), "critic")
    assert critic.micro is not None and critic.micro.size == 5  # an unset critic key is the actor's, resolved here


@pytest.mark.parametrize("role", sorted(WORKERS))
def test_a_worker_handed_a_whole_config_refuses_it_naming_what_it_takes(role):
    config = load_config(None, [*BASE, "algorithm.name=ppo", "algorithm.adv_estimator=gae", "reward_model.path=rm"])
    with pytest.raises(TypeError, match=rf"the {role} worker takes its RoleSpec \(rlcore.config.role_spec\(config, '{role}'\)\), "
                       "not a Config"):
        WORKERS[role](config)


def test_sft_builds_its_actors_spec_as_an_rl_config_of_its_sections_gives_it(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model: {path: m}\ndata: {train_files: [t], max_length: 64}\n"
                    "actor: {world_size: 2, ulysses_sequence_parallel_size: 2, lora: {rank: 4}}\n"
                    "trainer: {backend: ray, seed: 3}\n")
    sft = load_sft_config(str(path), [])
    spec = sft_actor_spec(sft, 7)
    t = sft.trainer
    rl = Config(model=sft.model.model_copy(update={"share_prompt_prefix": False}), data=DataConfig(train_files=["t"]), actor=sft.actor,
                trainer=TrainerConfig(total_steps=7, seed=t.seed, device=t.device, backend=t.backend))
    assert spec.layout.sequence_parallel == 2 and spec.total_steps == 7 and spec.seed == 3
    # the RL-only values: the longest rollout (SFT's: its rows' limit) and the preference losses (none)
    assert spec == dataclasses.replace(role_spec(rl, "actor"), longest_sequence=64, preference=None)


def test_rlcore_sft_makes_no_rl_config(own_model, tmp_path, monkeypatch):
    """A whole `rlcore sft` run (one step, in process) with every way of making an RL `Config`
    refused: the SFT config, its checks and its run parts never make one."""
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("rlcore sft made an RL Config")

    monkeypatch.setattr(Config, "__init__", refused)
    monkeypatch.setattr(Config, "model_validate", classmethod(refused))
    assert not hasattr(SFTConfig, "worker_config")
    out = tmp_path / "run"
    assert main(["sft", str(CONFIG_DIR / "tiny_sft.yaml"), f"model.path={own_model.model_dir}",
                 f"data.train_files=[{own_model.sft_file}]", "trainer.total_steps=1", "trainer.batch_size=4",
                 "trainer.loggers=[jsonl]", "trainer.device=cpu", f"trainer.output_dir={out}"]) == 0
    assert (out / "model" / "model.safetensors").is_file()
    with pytest.raises(AssertionError, match="made an RL Config"):  # the guard holds: an RL config cannot be made
        load_config(None, BASE)


def test_no_worker_module_reads_the_run_config():
    """A worker reads its `RoleSpec`, never `self.config` or `Config.layout_of` (another role's
    section is one attribute away there)."""
    found = []
    for path in sorted((Path(rlcore.__file__).parent / "workers").rglob("*.py")):
        if path.name == "shapes.py":  # preflight's check of every role's layout, before any worker exists
            continue
        tree = ast.parse(path.read_text())
        workers = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and any(getattr(b, "id", "") == "Worker" for b in c.bases)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("layout_of", "layout_key", "traits"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        for cls in workers:
            found += [f"{path.name}:{n.lineno} {cls.name} self.config" for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                      and n.attr == "config" and isinstance(n.value, ast.Name) and n.value.id == "self"]
    assert not found, found
