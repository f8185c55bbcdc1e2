"""Older spellings of config keys, still read. Each is rewritten to its current key on the raw tree
(the YAML file's mapping with the overrides applied) before validation, so a loaded config holds
only the current names (and a dumped `config.yaml` only those). A problem with a value given under
an older name is reported under that name (`written_as`). Each row carries the date after which it
may go: delete the row then (and its mention in README.md).

A renamed key (same values) is rewritten in the file's tree and in each override's key, so an
override under either name sets the one setting (the later wins); a key whose values changed too
(`values`) is rewritten once on the finished tree, where giving it beside its new name is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.config.base import ConfigError

log = logging.getLogger(__name__)

DROP = object()  # what `Spelling.values` returns for an old value that means "unset" (the default)

# Where the user wrote a (current) key: current key -> the spelling given, for error messages.
WrittenAs = dict[tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Spelling:
    """One older spelling: `old` is read as `new` (dotted-key parts)."""

    old: tuple[str, ...]
    new: tuple[str, ...]
    remove_after: str  # ISO date: the row (and its README mention) may be deleted after it
    values: Callable[[Any], Any] | None = None  # old value -> new value (or DROP); None: the same value


def _sleep_from_free_memory_when_idle(old: Any) -> Any:
    """true: always, false: never; null (a dumped config of an older run): the default."""
    if old is None:
        return DROP
    if not isinstance(old, bool):
        raise ValueError(f"free_memory_when_idle (the older spelling of rollout.sleep): expected true or false, got "
                         f"{str(old)[:40]!r}; use rollout.sleep: auto, always or never")
    return "always" if old else "never"


# An RL run's config (`rlcore.config.Config`).
RL_SPELLINGS: tuple[Spelling, ...] = (
    Spelling(("rollout", "free_memory_when_idle"), ("rollout", "sleep"), "2027-06-01", _sleep_from_free_memory_when_idle),
)

# An SFT run's config (`rlcore.config.SFTConfig`): the optimizer and the micro-batch budget were
# SFT's own sections before SFT trained on the actor worker.
SFT_SPELLINGS: tuple[Spelling, ...] = (
    Spelling(("optim",), ("actor", "optim"), "2027-06-01"),
    Spelling(("trainer", "max_tokens_per_micro_batch"), ("actor", "max_tokens_per_micro_batch"), "2027-06-01"),
)


def rewrite(tree: Any, spellings: Sequence[Spelling], written_as: WrittenAs, *, renames_only: bool = False) -> Any:
    """`tree` with each older spelling in it moved to its current key (`renames_only`: only the
    rows without a change of values); the caller's tree is left as it was. Both spellings in one
    tree, or a value an older key cannot take, is a `ConfigError` naming the keys as written."""
    if not isinstance(tree, dict):
        return tree  # not a mapping: reported by validation
    for spelling in spellings:
        if renames_only and spelling.values is not None:
            continue
        parent = _section(tree, spelling.old[:-1])
        if parent is None or spelling.old[-1] not in parent:
            continue
        tree = _copied_along(tree, spelling.old[:-1])
        tree = _copied_along(tree, spelling.new[:-1])
        tree = _moved(tree, spelling, written_as)
    return tree


def renamed_key(parts: list[str], spellings: Sequence[Spelling]) -> list[str]:
    """An override's dotted-key parts with an older spelling of a renamed key (a row without
    `values`) replaced by the current one."""
    for spelling in spellings:
        if spelling.values is None and tuple(parts[:len(spelling.old)]) == spelling.old:
            return [*spelling.new, *parts[len(spelling.old):]]
    return parts


def _moved(tree: dict[str, Any], spelling: Spelling, written_as: WrittenAs) -> dict[str, Any]:
    """`tree` (its path to both keys already copied) with `spelling.old`'s value at `spelling.new`."""
    old, new = spelling.old, spelling.new
    parent = _section(tree, old[:-1])
    assert parent is not None
    given = value = parent.pop(old[-1])
    if not parent and len(old) > 1:  # a section left empty by the move is dropped (its defaults)
        grandparent = _section(tree, old[:-2])
        assert grandparent is not None
        grandparent.pop(old[-2])
    shared = _shared_prefix(old, new)
    at = f"invalid config: {'.'.join(shared)}: " if shared else "invalid config: "
    refused: ValueError | None = None
    if spelling.values is not None:
        try:
            value = spelling.values(given)
        except ValueError as err:
            refused = err
        if value is DROP:
            return tree
    target = tree
    for i, part in enumerate(new[:-1]):
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid config: {'.'.join(new[:i + 1])}: expected a section")
        target = child
    old_name, new_name = ".".join(old[len(shared):]), ".".join(new[len(shared):])
    if new[-1] in target:
        raise ConfigError(f"{at}{old_name} and {new_name} are the same setting (the first its older spelling); give "
                          f"{new_name} alone")
    if refused is not None:
        raise ConfigError(f"{at}{refused}")
    target[new[-1]] = value
    written_as[new] = old
    if spelling.values is not None:
        log.warning("%s=%s is the older spelling of %s: read as %s=%s", ".".join(old), str(given).lower(),
                    ".".join(new), ".".join(new), value)
    return tree


def _section(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The mapping at `path` in `tree`, or None where a part is missing or not a mapping."""
    node: Any = tree
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _copied_along(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """`tree` with every mapping on `path` copied (shallow), so the rewrite leaves the caller's tree as it was."""
    top = dict(tree)
    node = top
    for part in path:
        child = node.get(part)
        if not isinstance(child, dict):
            break
        node[part] = dict(child)
        node = node[part]
    return top


def _shared_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The section two keys share (the keys themselves never)."""
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return a[:n]
