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


@pytest.mark.parametrize(
    "override, known",
    [
        ("algorithm.adv_estimator=grpoo", "grpo"),
        ("actor.policy_loss=nope", "vanilla"),
        ("actor.kl_loss_type=k4", "low_var_kl"),
        ("algorithm.kl_penalty=kl_div", "k1"),
    ],
)
def test_unknown_registered_name_is_refused_at_load_naming_key_and_choices(override, known):
    key, bad = override.split("=")
    with pytest.raises(ConfigError, match=rf"{key}: unknown .* '{bad}'; known: .*\b{known}\b"):
        load_config(CONFIGS / "tiny_grpo.yaml", BASE + [override])


def test_names_registered_before_load_are_accepted():
    from rlcore.algos import register_advantage_estimator, register_policy_loss, vanilla_policy_loss

    @register_advantage_estimator("test_config_zero", overwrite=True)
    def zero(*, token_level_rewards, **_):
        return token_level_rewards * 0, token_level_rewards * 0

    @register_policy_loss("test_config_vanilla", overwrite=True)
    def plain(*args, **kwargs):
        return vanilla_policy_loss(*args, **kwargs)

    cfg = load_config(None, BASE + ["algorithm.adv_estimator=test_config_zero", "actor.policy_loss=test_config_vanilla"])
    assert (cfg.algorithm.adv_estimator, cfg.actor.policy_loss) == ("test_config_zero", "test_config_vanilla")


def test_every_shipped_name_loads():
    from rlcore.algos import KL_KINDS, advantage_estimator_names, policy_loss_names

    for name in advantage_estimator_names():
        algorithm = "ppo" if name == "gae" else "grpo"
        assert load_config(None, BASE + [f"algorithm.name={algorithm}", f"algorithm.adv_estimator={name}"])
    for name in policy_loss_names():
        assert load_config(None, BASE + [f"actor.policy_loss={name}"]).actor.policy_loss == name
    for kind in KL_KINDS:
        cfg = load_config(None, BASE + [f"actor.kl_loss_type={kind}", f"algorithm.kl_penalty={kind}"])
        assert cfg.actor.kl_loss_type == cfg.algorithm.kl_penalty == kind


@pytest.mark.parametrize("kl_term", ["actor.use_kl_loss", "algorithm.use_kl_in_reward"])
def test_kl_term_without_reference_model_is_refused(kl_term):
    with pytest.raises(ConfigError, match=rf"algorithm.use_reference=false, but {kl_term} need"):
        load_config(None, BASE + ["algorithm.use_reference=false", f"{kl_term}=true"])


@pytest.mark.parametrize(("text", "said"), [
    ("actor:\n  optim: {lr: 1e-6\nfoo: [1,\n", "not valid YAML at line 3, column 4"),
    ("a: *nowhere\n", "found undefined alias"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("\tactor: 1\n", "not valid YAML at line 1"),
])
def test_a_config_file_that_is_not_yaml_is_one_line(tmp_path, text, said):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not|nested") as err:
        load_config(path)
    assert str(path) in str(err.value) and said in str(err.value) and "\n" not in str(err.value)


def test_a_config_file_that_is_not_text_or_an_override_that_is_not_yaml_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe a: 1")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override 'actor\.optim': not valid YAML at line 1, column 8"):
        load_config(None, ["actor.optim={lr: [1"])


def test_thousands_of_problems_are_one_line_naming_the_first(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("".join(f"key{i}: 1\n" for i in range(3000)) + "\"a\\nb\": 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "key0: unknown key" in message and "more" in message and "\n" not in message and len(message) < 2000


def test_an_integer_beyond_python_s_digit_limit_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'x': not a usable YAML value \(Exceeds the limit"):
        load_config(None, ["x=" + "9" * 5000])
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="c.yaml: not a usable YAML value"):
        load_config(path)
