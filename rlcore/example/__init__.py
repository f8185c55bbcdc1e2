"""The built-in tiny example: a synthetic arithmetic task and an SFT-warmed tiny Llama, built
deterministically from a seed with no downloads, so RL can be demonstrated anywhere; and the tool
example (`tool_task`, `tools`, `tool_build`), whose model must learn to call a calculator.

The names below load on first use: a tool worker that imports `rlcore.example.tools` must not pay
for torch and transformers, which the builders need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers
    from rlcore.example.build import (
        BUILDER_VERSION,
        Recipe,
        TinyExample,
        build_tiny_example,
        default_example_dir,
        load_tiny_example,
    )
    from rlcore.example.evaluate import evaluate_accuracy, extract_answer

_LAZY = {
    "BUILDER_VERSION": "rlcore.example.build", "Recipe": "rlcore.example.build", "TinyExample": "rlcore.example.build",
    "build_tiny_example": "rlcore.example.build", "default_example_dir": "rlcore.example.build",
    "load_tiny_example": "rlcore.example.build",
    "evaluate_accuracy": "rlcore.example.evaluate", "extract_answer": "rlcore.example.evaluate",
}

__all__ = ["BUILDER_VERSION", "Recipe", "TinyExample", "build_tiny_example", "default_example_dir", "evaluate_accuracy",
           "extract_answer", "load_tiny_example"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rlcore.example' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
