"""The per-algorithm traits table (`rlcore.algorithms`) is the only place that knows an algorithm by
its name: every other part asks it a question (generates? critic? which role trains?)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from name_checks import name_checks  # tests/ is on sys.path (pytest rootdir conftest)

import rlcore
from rlcore.algorithms import ALGORITHMS, names_where, traits_of
from rlcore.config import ConfigError, config_from_dict, load_config

PACKAGE = Path(rlcore.__file__).resolve().parent
TABLE = PACKAGE / "algorithms.py"
ABOUT_AN_ALGORITHM = re.compile(r"\balgorithm\b|\bname\b")  # config.algorithm.name, algorithm, self.algorithm, name


def algorithm_name_checks(source: str, filename: str) -> list[str]:
    """Each comparison of something about an algorithm (its name) with an algorithm's name:
    `config.algorithm.name == "ppo"`, `name in ("dpo", "kto")`, `algorithm != "rm"`."""
    return name_checks(source, filename, set(ALGORITHMS), ABOUT_AN_ALGORITHM)


def test_no_algorithm_name_checks_outside_the_table():
    """A new `algorithm.name == ...` (or `in (...)`, `!=`) anywhere in rlcore fails here: ask
    `Config.traits` / `rlcore.algorithms.traits_of` instead, or add the trait the question needs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != TABLE:
            found += algorithm_name_checks(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "algorithm-name checks outside rlcore/algorithms.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'if config.algorithm.name == "ppo": pass',
    'ok = self.algorithm.name in ("dpo", "kto")',
    'if name != "rm": pass',
    'x = algorithm == "kto" or 1',
    'if "grpo" == cfg.algorithm.name: pass',
    'y = config.algorithm.name not in {"grpo", "ppo"}',
])
def test_the_scan_finds_each_form_of_check(source):
    assert len(algorithm_name_checks(source, "x.py")) == 1


@pytest.mark.parametrize("source", [
    'if mode == "grpo": pass',  # an advantage estimator's mode, not an algorithm
    'if saved != algorithm: pass',  # two algorithms compared, no name spelled
    'about = {"algorithm": config.algorithm.name}',
])
def test_the_scan_leaves_other_comparisons_alone(source):
    assert algorithm_name_checks(source, "x.py") == []


def test_every_recipe_in_the_table_imports():
    for name, traits in ALGORITHMS.items():
        module, _, cls = traits.recipe.partition(":")
        recipe = getattr(importlib.import_module(module), cls)
        assert isinstance(recipe, type) and callable(getattr(recipe, "fit", None)), name


def test_one_recipe_per_family():
    assert {traits_of(n).recipe for n in ("grpo", "ppo")} == {"rlcore.trainer.on_policy:OnPolicyTrainer"}
    assert {traits_of(n).recipe for n in ("dpo", "kto")} == {"rlcore.trainer.preference:PreferenceTrainer"}
    with pytest.raises(ValueError, match="unknown algorithm 'ipo'; known: grpo, ppo"):
        traits_of("ipo")


def test_each_preference_row_names_an_objective_the_actor_trains_with():
    """The preference recipe hands its row's `objective` to `update_preference`; every row it runs
    names one the actor has (`rlcore.workers.preference.OBJECTIVES`), and no other row names one."""
    from rlcore.workers.preference import OBJECTIVES, DPOObjective, KTOObjective

    preference = traits_of("dpo").recipe
    for name, traits in ALGORITHMS.items():
        assert (traits.objective in OBJECTIVES) if traits.recipe == preference else traits.objective is None, name
    assert type(OBJECTIVES[traits_of("dpo").objective](None, None, None, None, None)) is DPOObjective  # type: ignore[arg-type,index]
    assert type(OBJECTIVES[traits_of("kto").objective](None, None, None, None, None)) is KTOObjective  # type: ignore[arg-type,index]


BASE = ["model.path=/m", "data.train_files=[t.parquet]", "actor.ppo_mini_batch_size=8", "data.train_batch_size=8"]
OVERRIDES = {"ppo": ["algorithm.adv_estimator=gae"]}


@pytest.mark.parametrize("name", names_where())
def test_a_configs_workers_follow_its_traits(name):
    """The worker roles a run starts are read from its algorithm's traits: the trained roles, a
    critic exactly where the algorithm trains one, the reference where it always needs one, and
    the rollout and rule scorer for every policy run."""
    config = load_config(None, BASE + [f"algorithm.name={name}", *OVERRIDES.get(name, [])])
    traits = config.traits
    roles = config.present_roles
    assert set(traits.trains) <= set(roles)
    assert ("critic" in roles) == traits.critic
    assert ("ref" in roles) == (traits.reference == "always")  # no KL term in BASE
    assert ("rollout" in roles and "reward" in roles) == traits.trains_policy
    assert config.old_log_probs_from_update == traits.generates  # one epoch, one mini-batch, sync: the on-policy update


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.name=ppo", "algorithm.adv_estimator=grpo"], "reads no values: algorithm.name=ppo trains a critic"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator 'gae' needs a critic: use algorithm.name=ppo"),
    (["algorithm.name=dpo", "trainer.off_policy=one_step"], "not supported by the 'dpo' control flow"),
    (["algorithm.name=rm", "actor.lora.rank=4"], "actor.lora: algorithm.name=rm trains a reward model"),
    (["algorithm.name=kto", "critic.lora.rank=4"], r"critic.lora: algorithm.name=kto has no critic \(ppo has one\)"),
    (["algorithm.name=kto", "preference.loss_type=ipo"], r"preference.loss_type: algorithm.name=kto does not read it \(a setting of dpo\)"),
    (["algorithm.name=dpo", "preference.desirable_weight=2"],
     r"preference.desirable_weight: algorithm.name=dpo does not read it \(a setting of kto\)"),
    (["preference.beta=0.3"], r"preference.beta: algorithm.name=grpo does not read it \(a setting of dpo and kto\)"),
])
def test_validation_reads_the_traits(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + overrides)


def test_a_config_passed_through_a_dump_loads_again():
    """The flows hand configs to their tasks as dumped dicts: every default then reads as written,
    and no setting the run does not read may be mistaken for one the user made."""
    for name in ("grpo", "ppo", "dpo", "kto", "rm"):
        config = load_config(None, BASE + [f"algorithm.name={name}", *OVERRIDES.get(name, [])])
        assert config_from_dict(config.model_dump(mode="json")).model_dump() == config.model_dump()
