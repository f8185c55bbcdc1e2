"""Older spellings of config keys (`rlcore.config.legacy`): each row of the tables loads, in a file
and in an override, to the same config as its current spelling; after load only the current name
exists; a problem with a value given under an older name names what the user wrote."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlcore.cli import main as cli_main
from rlcore.config import ConfigError, dump_config, load_config, load_sft_config
from rlcore.config.legacy import RL_SPELLINGS, SFT_SPELLINGS, Spelling

BASE = ["model.path=m", "data.train_files=[t]"]

# Per older key: (the value written under it, the same setting in the current spelling). A row
# added to a table without a case here fails `test_every_row_has_a_case`.
CASES: dict[tuple[str, ...], list[tuple[Any, Any]]] = {
    ("rollout", "free_memory_when_idle"): [(True, "always"), (False, "never")],
    ("optim",): [({"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
                  {"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"})],
    ("trainer", "max_tokens_per_micro_batch"): [(256, 256), ("auto", "auto")],
}
ROWS = [(s, False) for s in RL_SPELLINGS] + [(s, True) for s in SFT_SPELLINGS]


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for part in reversed(path):
        value = {part: value}
    return value


def _load(sft: bool, path: Path | None, overrides: list[str]) -> Any:
    return (load_sft_config if sft else load_config)(path, [*BASE, *overrides])


def _override(path: tuple[str, ...], value: Any) -> str:
    return f"{'.'.join(path)}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def test_every_row_has_a_case_and_a_removal_date():
    assert {s.old for s, _ in ROWS} == set(CASES)
    for spelling, _ in ROWS:
        assert datetime.date.fromisoformat(spelling.remove_after) > datetime.date(2026, 1, 1), spelling


@pytest.mark.parametrize(("spelling", "sft"), ROWS, ids=lambda r: ".".join(r.old) if isinstance(r, Spelling) else "")
def test_an_older_spelling_loads_as_its_current_one_in_a_file_and_an_override(tmp_path, spelling, sft):
    for old_value, new_value in CASES[spelling.old]:
        current = dump_config(_load(sft, None, [_override(spelling.new, new_value)]))
        assert dump_config(_load(sft, None, [_override(spelling.old, old_value)])) == current
        old_file, new_file = tmp_path / "old.yaml", tmp_path / "new.yaml"
        old_file.write_text(yaml.safe_dump(_nested(spelling.old, old_value)))
        new_file.write_text(yaml.safe_dump(_nested(spelling.new, new_value)))
        assert dump_config(_load(sft, old_file, [])) == dump_config(_load(sft, new_file, [])) == current
        section = yaml.safe_load(current)
        for part in spelling.old[:-1]:
            section = section[part]
        assert spelling.old[-1] not in section  # after load only the current name exists


def test_a_renamed_key_in_an_override_sets_the_one_setting_whichever_spelling_the_file_used(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("optim: {lr: 1.0e-4}\n")
    new.write_text("actor: {optim: {lr: 1.0e-4}}\n")
    for file in (old, new):
        for override in ("optim.lr=3e-3", "actor.optim.lr=3e-3"):
            assert load_sft_config(file, [*BASE, override]).actor.optim.lr == pytest.approx(3e-3)


@pytest.mark.parametrize(("sft", "overrides", "said"), [
    (True, ["optim.lr=-1"], "invalid config: optim.lr: Input should be greater than 0"),
    (True, ["optim=5"], "invalid config: optim: Input should be a valid dictionary"),
    (True, ["trainer.max_tokens_per_micro_batch=lots"],
     "invalid config: trainer.max_tokens_per_micro_batch: expected a number of tokens (at least 1) or auto, got 'lots'"),
    (True, ["actor.optim.lr=-1"], "invalid config: actor.optim.lr: Input should be greater than 0"),  # as written
    (False, ["rollout.free_memory_when_idle=sometimes"], "invalid config: rollout: free_memory_when_idle (the older "
     "spelling of rollout.sleep): expected true or false, got 'sometimes'; use rollout.sleep: auto, always or never"),
    (False, ["rollout.free_memory_when_idle=true", "rollout.sleep=never"], "invalid config: rollout: "
     "free_memory_when_idle and sleep are the same setting (the first its older spelling); give sleep alone"),
])
def test_a_problem_under_an_older_name_names_what_the_user_wrote(sft, overrides, said):
    with pytest.raises(ConfigError) as err:
        _load(sft, None, overrides)
    assert str(err.value).startswith(said)


def test_a_value_under_an_older_name_in_a_file_is_named_as_written(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("optim: {lr: 1.0e-4, warmup_steps: -1}\n")
    with pytest.raises(ConfigError, match=r"^invalid config: optim\.warmup_steps: Input should be greater than or equal to 0$"):
        load_sft_config(file, BASE)
    with pytest.raises(ConfigError, match=r"^invalid config: actor\.optim\.warmup_steps: "):  # the override wrote it so
        load_sft_config(file, [*BASE, "actor.optim.warmup_steps=-2"])


def test_the_cli_names_the_older_key_in_one_line(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("model: {path: m}\ndata: {train_files: [t]}\noptim: {lr: -1}\n")
    assert cli_main(["sft", str(config)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlcore: error: invalid config: optim.lr: Input should be greater than 0"]


def test_the_caller_s_tree_is_left_as_it_was():
    from rlcore.config import config_from_dict, sft_config_from_dict

    rl = {"model": {"path": "m"}, "data": {"train_files": ["t"]}, "rollout": {"free_memory_when_idle": True}}
    sft = {"model": {"path": "m"}, "data": {"train_files": ["t"]}, "optim": {"lr": 3e-3},
           "trainer": {"max_tokens_per_micro_batch": 256}}
    rl_copy, sft_copy = yaml.safe_load(yaml.safe_dump(rl)), yaml.safe_load(yaml.safe_dump(sft))
    assert config_from_dict(rl).rollout.sleep == "always"
    assert sft_config_from_dict(sft).actor.max_tokens_per_micro_batch == 256
    assert (rl, sft) == (rl_copy, sft_copy)
