"""The tiny example's build process: `python -m rlcore.example.pinned_build ROOT SEED RECIPE_JSON`.

Started by `build_tiny_example` under `PINNED_ENV` (see `rlcore.example.build`); it refuses to
run without it, since a build here that silently used the machine's own kernels would record a
hash that other machines cannot reproduce. Log lines go to stdout, one per line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from rlcore.example.build import PINNED_ENV, Recipe, build_into_pinned

    wrong = {k: os.environ.get(k) for k, v in PINNED_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"rlcore.example.pinned_build: environment not pinned: {wrong}; use build_tiny_example()")
    root, seed, recipe = Path(argv[0]), int(argv[1]), Recipe.from_json(json.loads(argv[2]))
    build_into_pinned(root, seed, recipe, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
