"""Reading a config: a YAML file (optional), dotted command-line overrides (`actor.optim.lr=1e-6`),
the older spellings rewritten (`rlcore.config.legacy`), then validation; and writing one back."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from rlcore.config import legacy
from rlcore.config.base import ConfigError, Section, format_validation_error
from rlcore.config.root import Config
from rlcore.config.sft import SFTConfig
from rlcore.redact import redact_tree

Model = TypeVar("Model", bound=Section)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value) with the value typed by YAML (1e-6, true, [1,2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key segment")
    value = _safe_yaml(raw, f"override {key.strip()!r}") if raw.strip() else ""
    return parts, value


def _safe_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, or a `ConfigError` naming `where` and the line and column of what is
    not YAML (a YAML typo is one line, not a parser traceback)."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = err.problem or err.context or "not YAML"
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    except ValueError as err:  # a constructor's refusal: an integer of more than 4,300 digits, say
        raise ConfigError(f"{where}: not a usable YAML value ({str(err).split(';')[0][:200]})") from None


def set_key(tree: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    """`tree[a][b][c] = value` for `parts` ["a", "b", "c"], making sections on the way; a part
    that is already a value, not a section, is a `ConfigError` naming the key."""
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _validated(model: type[Model], tree: dict[str, Any], spellings: Sequence[legacy.Spelling],
               written_as: legacy.WrittenAs) -> Model:
    """`tree` with its older spellings rewritten, validated as `model`; a problem is one
    `ConfigError` line naming each key as the user wrote it."""
    tree = legacy.rewrite(tree, spellings, written_as)
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, written_as)) from None


def config_from_dict(tree: dict[str, Any]) -> Config:
    return _validated(Config, tree, legacy.RL_SPELLINGS, {})


def sft_config_from_dict(tree: dict[str, Any]) -> SFTConfig:
    return _validated(SFTConfig, tree, legacy.SFT_SPELLINGS, {})


def _config_tree(path: str | Path | None, overrides: Sequence[str], spellings: Sequence[legacy.Spelling],
                 written_as: legacy.WrittenAs) -> dict[str, Any]:
    """A YAML file's mapping (optional) with dotted overrides applied, not yet validated; an older
    spelling of a renamed key is rewritten in the file and in each override's key (so either
    spelling of an override sets the one setting), each recorded in `written_as`."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the config file ({err.strerror or err})") from None
        loaded = _safe_yaml(text, str(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        tree = legacy.rewrite(loaded, spellings, written_as, renames_only=True)
    for text in overrides:
        parts, value = parse_override(text)
        current = legacy.renamed_key(parts, spellings)
        written_as[tuple(current)] = tuple(parts)
        set_key(tree, current, value)
    return tree


# The webhook URL when the config leaves `registry.webhook_url` unset: a secret kept out of config
# files, command lines and Prefect parameters (a served pipeline's runs inherit it from `pipeline serve`).
WEBHOOK_ENV = "RLCORE_WEBHOOK_URL"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (optional), apply dotted overrides, validate; `registry.webhook_url` unset
    there is $RLCORE_WEBHOOK_URL."""
    written_as: legacy.WrittenAs = {}
    tree = _config_tree(path, overrides, legacy.RL_SPELLINGS, written_as)
    registry = tree.setdefault("registry", {})
    if isinstance(registry, dict) and registry.get("webhook_url") is None and os.environ.get(WEBHOOK_ENV):
        registry["webhook_url"] = os.environ[WEBHOOK_ENV]
    return _validated(Config, tree, legacy.RL_SPELLINGS, written_as)


def load_sft_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SFTConfig:
    """`load_config` for an SFT run (`rlcore sft`). An older spelling of a key (`optim.lr` for
    `actor.optim.lr`) addresses the same setting, in the file and in an override alike."""
    written_as: legacy.WrittenAs = {}
    return _validated(SFTConfig, _config_tree(path, overrides, legacy.SFT_SPELLINGS, written_as), legacy.SFT_SPELLINGS,
                      written_as)


def dump_config(config: Config | SFTConfig) -> str:
    """The resolved config as YAML, secrets redacted (`rlcore.redact`): the run folder's
    `config.yaml` is read, shared and logged as an MLflow artifact, so it must not carry the
    webhook's credentials. A run reloaded from it gets its secrets from its overrides again."""
    text: str = yaml.safe_dump(redact_tree(config.model_dump(mode="json")), sort_keys=False)
    return text
