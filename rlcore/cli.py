"""`rlcore` command line: train from a config, build the tiny example, run the pipeline."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rlcore.config import ConfigError, load_config

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _cmd_train(args: argparse.Namespace) -> int:
    from rlcore.trainer.run import run_training

    config = load_config(args.config, args.overrides)
    history = run_training(config)
    last = history[-1] if history else {}
    print(json.dumps({k: v for k, v in last.items() if k.startswith(("val/", "acc/", "reward/"))}, indent=1))
    return 0


def _cmd_example_build(args: argparse.Namespace) -> int:
    from rlcore.example import build_tiny_example

    example = build_tiny_example(Path(args.out) if args.out else None, seed=args.seed, force=args.force)
    print(example.model_dir)
    return 0


def tiny_example_overrides(example, output_dir: str) -> list[str]:
    return [
        f"model.path={example.model_dir}",
        f"data.train_files=[{example.train_file}]",
        f"data.val_files=[{example.val_file}]",
        f"trainer.output_dir={output_dir}",
    ]


def _cmd_pipeline_run(args: argparse.Namespace) -> int:
    """The main job on the built-in tiny example: build it, train GRPO, report before/after."""
    from rlcore.example import build_tiny_example
    from rlcore.trainer.run import run_training

    example = build_tiny_example(seed=args.seed)
    config_path = CONFIG_DIR / f"tiny_{args.algorithm}.yaml"
    overrides = tiny_example_overrides(example, args.output_dir) + list(args.overrides)
    config = load_config(config_path, overrides)
    history = run_training(config)
    vals = [h for h in history if "val/acc" in h]
    from rlcore.tracking import read_jsonl

    records = read_jsonl(Path(config.trainer.output_dir) / "metrics.jsonl")
    before = next((r["val/acc"] for r in records if r["step"] == 0 and "val/acc" in r), None)
    after = vals[-1]["val/acc"] if vals else None
    summary = {
        "algorithm": args.algorithm,
        "val_acc_before": before,
        "val_acc_after": after,
        "steps": config.trainer.total_steps,
        "run_dir": str(Path(config.trainer.output_dir).resolve()),
        "model": str(Path(config.trainer.output_dir).resolve() / "checkpoints"),
    }
    print(json.dumps(summary, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training config: rlcore train CONFIG [dotted.key=value ...]")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*")
    train.set_defaults(func=_cmd_train)

    example = sub.add_parser("example", help="the built-in tiny example")
    example_sub = example.add_subparsers(dest="example_command", required=True)
    build = example_sub.add_parser("build", help="build (or reuse) the tiny model and data; prints the model folder")
    build.add_argument("--out", default=None)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true")
    build.set_defaults(func=_cmd_example_build)

    pipeline = sub.add_parser("pipeline", help="the end-to-end pipeline")
    pipeline_sub = pipeline.add_subparsers(dest="pipeline_command", required=True)
    run = pipeline_sub.add_parser("run", help="tiny example end to end: build, train, report accuracy before/after")
    run.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--output-dir", default="runs/tiny-pipeline")
    run.add_argument("overrides", nargs="*")
    run.set_defaults(func=_cmd_pipeline_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"rlcore: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
