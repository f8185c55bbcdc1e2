"""The tool example's tool: a calculator for integer arithmetic, safe to call on model output.

Listed in a config as `rollout.agent.tools: [rlcore.example.tools:calculator]` and run, like every
tool, in rlcore's sandboxed worker processes (timeouts, a memory limit). Its JSON schema comes from
its signature and docstring (transformers' `get_json_schema`, what chat templates render tools from).
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
MAX_DIGITS = 60  # results (and operands) beyond this are refused: no 10**10**10 from a sampled expression


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        result = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if len(str(abs(result))) > MAX_DIGITS:
            raise ValueError("result too large")
        return int(result)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * // % and parentheses, e.g. "1234+5678"
    """
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    tree = ast.parse(expression.strip(), mode="eval")
    return str(_eval(tree.body))
