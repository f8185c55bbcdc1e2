"""A tool's OpenAI-style schema, read from its function (what `rlcore.rewards.user_code`'s child
interpreter runs on a loaded tool) or checked as given (a .json schema file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .registry import SpecError


class ToolSpecError(SpecError):
    """A tool that cannot be used: its spec does not load, it has no usable schema, or two tools
    share a name. The message names the spec."""


def checked_schema(schema: Any, spec: str) -> dict[str, Any]:
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) \
            or not isinstance(schema["function"].get("name"), str):
        raise ToolSpecError(f"tool spec {spec!r}: the schema must be {{'type': 'function', 'function': {{'name': ..., "
                            f"'parameters': ...}}}}, got {schema!r:.120}")
    return dict(schema)


def tool_schema(fn: Callable[..., Any], spec: str) -> dict[str, Any]:
    """The OpenAI-style schema of `fn`: its `tool_schema` attribute, or transformers'
    `get_json_schema` (type hints and a docstring with an Args section)."""
    schema = getattr(fn, "tool_schema", None)
    if schema is None:
        from transformers.utils.chat_template_utils import get_json_schema  # not at import: tool workers never need it

        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ToolSpecError(f"tool spec {spec!r}: no schema: give the function a `tool_schema` dict, or type hints "
                                f"and a docstring with an Args section ({type(e).__name__}: {e})") from e
    return checked_schema(schema, spec)


__all__ = ["ToolSpecError", "checked_schema", "tool_schema"]
