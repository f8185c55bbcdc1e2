"""Config loading: YAML + dotted overrides, and errors that name the key."""

from pathlib import Path

import pytest

from rlcore.config import ConfigError, dump_config, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "rlcore" / "configs"
BASE = ["model.path=/m", "data.train_files=[/t.parquet]"]


def test_overrides_are_typed_by_yaml():
    cfg = load_config(CONFIGS / "tiny_grpo.yaml", BASE + ["actor.optim.lr=1e-6", "rollout.n=4", "trainer.val_before_train=false"])
    assert cfg.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.rollout.n == 4
    assert cfg.trainer.val_before_train is False
    assert cfg.data.train_files == ["/t.parquet"]


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lrr: unknown key"):
        load_config(None, BASE + ["actor.optim.lrr=1e-6"])


def test_ill_typed_value_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.n: "):
        load_config(None, BASE + ["rollout.n=many"])


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match=r"model: Field required"):
        load_config(None, ["data.train_files=[/t]"])


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        load_config(None, BASE + ["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="adv_estimator"):
        load_config(None, BASE + ["algorithm.name=ppo"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, BASE + ["actor.optim.lr"])


def test_dump_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "tiny_ppo.yaml", BASE)
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_needs_reference_follows_kl_settings():
    assert not load_config(None, BASE).needs_reference
    assert load_config(None, BASE + ["actor.use_kl_loss=true"]).needs_reference
    assert load_config(None, BASE + ["algorithm.use_kl_in_reward=true"]).needs_reference
