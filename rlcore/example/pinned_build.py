"""The tiny examples' build process: `python -m rlcore.example.pinned_build ROOT SEED RECIPE_JSON [TASK]`
(TASK: `arith`, the default; `tool`; or `tool-native`).

Started by `build_tiny_example` (and `build_tool_example(pinned=True)`) under `PINNED_ENV` (see
`rlcore.example.build`); it refuses to run without it, since a build here that silently used the
machine's own kernels would record a hash that other machines cannot reproduce. `tool-native` is
the tool example's default build: one thread, this CPU's own kernels (reproducible on the machine,
~2.5x faster than the pinned float path). Log lines go to stdout, one per line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from rlcore.example.build import PINNED_ENV, Recipe, build_into_pinned

    root, seed, task = Path(argv[0]), int(argv[1]), argv[3] if len(argv) > 3 else "arith"
    wrong = {k: os.environ.get(k) for k, v in PINNED_ENV.items() if os.environ.get(k) != v}
    if wrong and task != "tool-native":
        raise SystemExit(f"rlcore.example.pinned_build: environment not pinned: {wrong}; use build_tiny_example()")
    say = lambda line: print(line, flush=True)  # noqa: E731
    if task in ("tool", "tool-native"):
        from rlcore.example.tool_build import ToolRecipe, build_tool_in_child

        build_tool_in_child(root, seed, ToolRecipe.from_json(json.loads(argv[2])), say, pinned=task == "tool")
    else:
        build_into_pinned(root, seed, Recipe.from_json(json.loads(argv[2])), say)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
