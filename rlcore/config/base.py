"""What every section module shares: the error type, the section base, the algorithm registries'
names (read at validation time) and the one formatting of a validation error."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rlcore.errors import RLCoreError


class ConfigError(RLCoreError, ValueError):
    """A configuration problem; the message names the dotted key."""


class Section(BaseModel):
    # allow_inf_nan=False: `actor.optim.lr=inf` (or nan) is an error at load, not an all-NaN model
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def registered_names(kind: Literal["advantage estimator", "policy loss", "KL estimator"]) -> list[str]:
    """The names rlcore.algos resolves for `kind` at run time ("advantage estimator", "policy loss",
    "KL estimator"), read when a config is validated, so names registered before loading count.
    Imported here rather than at module level: `import rlcore.config` stays free of torch."""
    from rlcore import algos

    if kind == "advantage estimator":
        return algos.advantage_estimator_names()
    if kind == "policy loss":
        return algos.policy_loss_names()
    if kind == "KL estimator":
        return list(algos.KL_KINDS)
    raise ValueError(f"no registry of {kind!r}")


def estimator_inputs(name: str) -> frozenset[str]:
    """What advantage estimator `name` reads beyond the rewards ("values": a critic's; "reward_baselines":
    ReMax's greedy baseline), as rlcore.algos registered it (imported here: see `registered_names`)."""
    from rlcore import algos

    return algos.advantage_estimator_inputs(name)


def check_registered(kind: Literal["advantage estimator", "policy loss", "KL estimator"], name: str) -> str:
    """`name` if rlcore.algos knows it as a `kind`, else an error listing the names it knows (pydantic
    prefixes the dotted key), so a typo fails at load, before any model is loaded."""
    known = registered_names(kind)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}")
    return name

def differs_from_default(section: BaseModel, key: str) -> bool:
    """`section.key` is not its field's default: a setting the user made. By value, not by
    `model_fields_set`, so a config dumped and loaded again (as the flows pass it) reads the same."""
    field = type(section).model_fields[key]
    default = field.get_default(call_default_factory=True)
    return bool(getattr(section, key) != default)


MAX_PROBLEMS_SHOWN = 12  # a hostile file can hold thousands; the first few say what to fix


def format_validation_error(err: ValidationError, written_as: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> str:
    """One line: "invalid config: " and each problem under its dotted key. `written_as` maps a key
    (or a section) to the older spelling the user wrote it under (`rlcore.config.legacy`), so a
    problem is reported under the name the user wrote."""
    lines = []
    errors = err.errors()
    for e in errors[:MAX_PROBLEMS_SHOWN]:
        loc = ".".join(str(p) if str(p).isprintable() else repr(p) for p in _as_written(e["loc"], written_as or {}))[:200] or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        elif e["type"] == "value_error":  # our validators' own messages, without pydantic's "Value error, "
            lines.append(f"{loc}: {e.get('ctx', {}).get('error', e['msg'])}")
        else:
            lines.append(f"{loc}: {e['msg']}")
    more = f"; and {len(errors) - MAX_PROBLEMS_SHOWN} more" if len(errors) > MAX_PROBLEMS_SHOWN else ""
    return "invalid config: " + "; ".join(lines) + more


def _as_written(loc: tuple[int | str, ...], written_as: dict[tuple[str, ...], tuple[str, ...]]) -> tuple[int | str, ...]:
    """`loc` with its longest prefix that `written_as` knows replaced by what the user wrote."""
    for cut in range(len(loc), 0, -1):
        spelled = written_as.get(tuple(str(p) for p in loc[:cut]))
        if spelled is not None:
            return (*spelled, *loc[cut:])
    return loc
