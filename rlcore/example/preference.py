"""A preference set for the tiny arithmetic example, made from its own problems.

Chosen is the correct answer; rejected is the plausible wrong answer of the flawed teacher's
kind: the carry-dropped sum when the units carry (57+68 -> 115, what the SFT model tends to say),
otherwise a spurious carry (+10). DPO rows (and a reward model's training pairs) pair them; KTO rows
list each completion on its own with a label. Train rows come from the example's train problems, the held-out pairs from its
validation problems, so held-out preference accuracy and task accuracy measure the same prompts.

Written next to the example as `<example>-preference-v<VERSION>/` (atomic, cached like the
example itself); the example's own files and recipe are untouched.

`python -m rlcore.example.preference [--seed N]` builds it and prints `rlcore train` overrides.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlcore.algorithms import ALGORITHMS, names_where, traits_of
from rlcore.data.io import read_rows, write_rows
from rlcore.example.build import TinyExample, build_tiny_example
from rlcore.example.task import DATA_SOURCE, Problem, format_response

PREFERENCE_VERSION = 1
# the algorithms that train on this set: DPO, KTO, a reward model
PREFERENCE_ALGORITHMS = [name for name in names_where() if ALGORITHMS[name].data in ("pairwise", "unpaired")]
_QUESTION = re.compile(r"^(\d+)\+(\d+)=$")


@dataclass(frozen=True)
class PreferenceFiles:
    root: Path
    dpo_train: Path
    dpo_val: Path
    kto_train: Path
    kto_val: Path


def rejected_answer(p: Problem) -> int:
    """The plausible wrong answer: carry dropped when there is a carry, else a spurious carry."""
    return p.carry_dropped if p.carries else p.answer + 10


def _problems(rl_file: Path) -> list[Problem]:
    out = []
    for row in read_rows(rl_file):
        m = _QUESTION.match(row["prompt"][-1]["content"])
        if m is None:
            raise ValueError(f"{rl_file}: not a tiny-example prompt: {row['prompt']!r}")
        out.append(Problem(int(m.group(1)), int(m.group(2))))
    return out


def dpo_row(p: Problem, split: str, index: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": p.question}],
        "chosen": format_response(p.answer),
        "rejected": format_response(rejected_answer(p)),
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "carry": p.carries},
    }


def kto_rows(p: Problem, split: str, index: int) -> list[dict]:
    """Both completions of a problem, unpaired: the correct one desirable, the wrong one not."""
    base = {"prompt": [{"role": "user", "content": p.question}], "data_source": DATA_SOURCE,
            "extra_info": {"split": split, "index": index, "carry": p.carries}}
    return [{**base, "completion": format_response(p.answer), "label": True},
            {**base, "completion": format_response(rejected_answer(p)), "label": False}]


def preference_dir(example: TinyExample) -> Path:
    return Path(example.root).parent / f"{Path(example.root).name}-preference-v{PREFERENCE_VERSION}"


def _files(root: Path) -> PreferenceFiles:
    d = root / "data"
    return PreferenceFiles(root, d / "dpo_train.parquet", d / "dpo_val.parquet", d / "kto_train.parquet", d / "kto_val.parquet")


def build_preference_set(example: TinyExample | None = None, seed: int = 0, force: bool = False) -> PreferenceFiles:
    """Build (or return the cached) preference set of the tiny example for `seed`."""
    example = example or build_tiny_example(seed=seed)
    root = preference_dir(example)
    if (root / ".complete").exists() and not force:
        return _files(root)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = _files(tmp)
        train, val = _problems(Path(example.train_file)), _problems(Path(example.val_file))
        write_rows([dpo_row(p, "train", i) for i, p in enumerate(train)], files.dpo_train)
        write_rows([dpo_row(p, "val", i) for i, p in enumerate(val)], files.dpo_val)
        write_rows([r for i, p in enumerate(train) for r in kto_rows(p, "train", i)], files.kto_train)
        write_rows([r for i, p in enumerate(val) for r in kto_rows(p, "val", i)], files.kto_val)
        (tmp / ".complete").write_text("ok\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _files(root)


def train_overrides(example: TinyExample, files: PreferenceFiles, algorithm: str, output_dir: str) -> list[str]:
    """`rlcore train rlcore/configs/tiny_<algorithm>.yaml <these>`: the held-out pairs validate every
    algorithm (preference accuracy needs pairs); for DPO and KTO the example's RL validation file
    gives task accuracy. `rm` (a reward model) trains on the pairs."""
    traits = traits_of(algorithm)
    train = files.kto_train if traits.data == "unpaired" else files.dpo_train
    task = [f"preference.task_val_files=[{example.val_file}]"] if traits.task_validation else []
    return [
        f"model.path={example.model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{files.dpo_val}]",
        *task,
        f"trainer.output_dir={output_dir}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.example.preference", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algorithm", choices=PREFERENCE_ALGORITHMS, default="dpo")
    parser.add_argument("--output-dir", default="runs/tiny_pref")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    example = build_tiny_example(seed=args.seed)
    files = build_preference_set(example, force=args.force)
    print(" ".join(train_overrides(example, files, args.algorithm, args.output_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
