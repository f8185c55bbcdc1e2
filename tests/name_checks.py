"""One AST scan for "a thing known by its name": a comparison that spells a registered name
(`"vllm"`, `("dpo", "kto")`) against an expression about that kind of thing
(`config.rollout.backend`, `algorithm.name`). The algorithm and rollout-backend tables use it to
keep name checks inside their own modules."""

from __future__ import annotations

import ast
import re
from collections.abc import Set


def _names_in(node: ast.expr, names: Set[str]) -> set[str]:
    """The names a literal spells: "ppo", or ("dpo", "kto") / ["grpo", "ppo"] / {"rm"}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(names)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e, names) for e in node.elts)) if node.elts else set()
    return set()


def name_checks(source: str, filename: str, names: Set[str], about: re.Pattern[str]) -> list[str]:
    """Each comparison in `source` with one side spelling one of `names` and another side whose
    text matches `about`, as "file:line: code"."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        spelled = [o for o in operands if _names_in(o, names)]
        subject = [o for o in operands if not _names_in(o, names) and about.search(ast.unparse(o))]
        if spelled and subject:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found
