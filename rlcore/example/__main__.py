"""`python -m rlcore.example [--seed N] [--out DIR] [--force]`: build the tiny example."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from rlcore.example.build import build_tiny_example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.example", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    example = build_tiny_example(args.out, seed=args.seed, force=args.force)
    print(json.dumps(example.to_json() | {"root": str(example.root)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
