"""Everything a config names is checked before any model loads (rlcore.trainer.preflight), each
problem naming its key; `rlcore train` prints rlcore's own errors as a message, not a traceback
(the traceback behind -v, before or after the subcommand).

The runs here are refused before the recipe starts, so a stand-in model folder (config.json,
weights, the example's real tokenizer) and small data files are enough: no model ever loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR, main
from rlcore.config import load_config
from rlcore.data import write_rows
from rlcore.errors import RLCoreError
from rlcore.example.tokenizer import build_tokenizer
from rlcore.trainer.preflight import PreflightError, preflight
from rlcore.trainer.run import make_trainer

ROOT = Path(__file__).resolve().parents[1]


def rl_row(q: str = "1+1=", gt: str = "2") -> dict:
    return {"data_source": "tiny_arith", "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": gt, "style": "rule"}}


class Setup:
    """A stand-in model folder and data files, and configs pointing at them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps({"model_type": "llama"}))
        save_file({"stand_in": torch.zeros(2)}, self.model / "model.safetensors")  # preflight reads its header only
        build_tokenizer().save_pretrained(str(self.model))
        self.train = write_rows([rl_row(f"{i}+1=", str(i + 1)) for i in range(8)], root / "train.parquet")
        self.val = write_rows([rl_row()], root / "val.jsonl")
        self.pairs = write_rows([{"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3"}] * 4, root / "pairs.parquet")
        self.out = root / "run"

    def args(self, algorithm: str = "grpo", *extra: str) -> list[str]:
        train = self.pairs if algorithm == "dpo" else self.train
        val = self.pairs if algorithm == "dpo" else self.val
        task = [f"preference.task_val_files=[{self.val}]"] if algorithm == "dpo" else []
        return [f"model.path={self.model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", *task,
                f"trainer.output_dir={self.out}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                "trainer.loggers=[jsonl]", *extra]

    def config(self, algorithm: str = "grpo", *extra: str):
        return load_config(CONFIG_DIR / f"tiny_{algorithm}.yaml", self.args(algorithm, *extra))


@pytest.fixture
def setup(tmp_path) -> Setup:
    return Setup(tmp_path)


def test_a_config_whose_names_all_resolve_passes(setup):
    for algorithm in ("grpo", "ppo", "dpo"):
        preflight(setup.config(algorithm))
    preflight(setup.config("ppo", f"critic.model_path={setup.model}"))


def _broken_model(setup: Setup, drop: str) -> Path:
    folder = setup.root / f"model-without-{drop}"
    folder.mkdir()
    for f in setup.model.iterdir():
        if not f.name.startswith(drop):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _file(setup: Setup, name: str, text: str) -> Path:
    path = setup.root / name
    path.write_text(text)
    return path


# (algorithm, override builder, the key the message must start with, words it must contain)
CASES = {
    "model missing": ("grpo", lambda s: [f"model.path={s.root / 'nope'}"], "model.path", "does not exist"),
    "model is a file": ("grpo", lambda s: [f"model.path={s.train}"], "model.path", "is not a folder"),
    "model without config.json": ("grpo", lambda s: [f"model.path={_broken_model(s, 'config')}"], "model.path",
                                  "has no config.json"),
    "model without weights": ("grpo", lambda s: [f"model.path={_broken_model(s, 'model.safetensors')}"], "model.path",
                              "holds no weights"),
    "model without tokenizer": ("grpo", lambda s: [f"model.path={_broken_model(s, 'tokenizer')}"], "model.path",
                                "has no tokenizer"),
    "critic model missing": ("ppo", lambda s: [f"critic.model_path={s.root / 'nope'}"], "critic.model_path",
                             "does not exist"),
    "no train files": ("grpo", lambda s: ["data.train_files=[]"], "data.train_files", "empty"),
    "train file missing": ("grpo", lambda s: [f"data.train_files=[{s.root / 'nope.parquet'}]"], "data.train_files[0]",
                           "not found"),
    "train file not parquet": ("grpo", lambda s: [f"data.train_files=[{_file(s, 'x.parquet', 'a,b')}]"],
                               "data.train_files[0]", "not a readable parquet file"),
    "val file of unknown format": ("grpo", lambda s: [f"data.val_files=[{_file(s, 'v.csv', 'a,b')}]"],
                                   "data.val_files[0]", "unknown dataset format"),
    "train file lacks a field": ("grpo", lambda s: [f"data.train_files=[{write_rows([{'prompt': 'x', 'data_source': 'd'}], s.root / 'p.jsonl')}]"],
                                 "data.train_files[0]", "lacks the field(s) reward_model"),
    "dpo trains on RL rows": ("dpo", lambda s: [f"data.train_files=[{s.train}]"], "data.train_files[0]",
                              "lacks the field(s) chosen, rejected"),
    "task_val file missing": ("dpo", lambda s: [f"preference.task_val_files=[{s.root / 'nope.parquet'}]"],
                              "preference.task_val_files[0]", "not found"),
    "reward file missing": ("grpo", lambda s: [f"reward.function={s.root / 'nope.py'}:score"], "reward.function",
                            "does not exist"),
    "reward file broken": ("grpo", lambda s: [f"reward.function={_file(s, 'r.py', 'def score(:')}:score"],
                           "reward.function", "SyntaxError"),
    "reward file lacks the function": ("grpo", lambda s: [f"reward.function={_file(s, 'r.py', 'x = 1')}:score"],
                                       "reward.function", "has no attribute 'score'"),
    "reward module missing": ("grpo", lambda s: ["reward.function=no_such_module_rlcore:score"], "reward.function",
                              "cannot import module"),
    "a data source nothing scores": ("grpo", lambda s: [f"data.train_files=[{_mine(s, 'mine.parquet')}]"],
                                     "reward.function", "data_source 'my_task' (data.train_files[0]) has no built-in scorer"),
    "a validation data source nothing scores": ("grpo", lambda s: [f"data.val_files=[{_mine(s, 'mine.jsonl')}]"],
                                                "reward.function", "data_source 'my_task' (data.val_files[0])"),
    "a task_val data source nothing scores": ("dpo", lambda s: [f"preference.task_val_files=[{_mine(s, 'mine.jsonl')}]"],
                                              "reward.function", "data_source 'my_task' (preference.task_val_files[0])"),
    "resume path missing": ("grpo", lambda s: [f"trainer.resume={s.root / 'no' / 'such'}"], "trainer.resume",
                            "does not exist"),
    "resume not a checkpoint": ("grpo", lambda s: [f"trainer.resume={s.model}"], "trainer.resume",
                                "is not a checkpoint folder"),
    "resume incomplete": ("grpo", lambda s: [f"trainer.resume={_step_dir(s, None)}"], "trainer.resume",
                          "no COMPLETE.json"),
    "resume misses a file": ("grpo", lambda s: [f"trainer.resume={_step_dir(s, {'actor/model.safetensors': 10})}"],
                             "trainer.resume", "missing file actor/model.safetensors"),
    "resume another algorithm": ("grpo", lambda s: [f"trainer.resume={_step_dir(s, {}, 'ppo')}"], "trainer.resume",
                                 "is a ppo checkpoint"),
    "output dir is a file": ("grpo", lambda s: [f"trainer.output_dir={s.train}"], "trainer.output_dir",
                             "is not a folder"),
}


def _mine(setup: Setup, name: str) -> Path:
    """RL rows of a data source no built-in scorer knows."""
    return write_rows([{**rl_row(f"{i}+2=", str(i + 2)), "data_source": "my_task"} for i in range(8)], setup.root / name)


def test_a_data_source_with_a_scorer_of_its_own_passes(setup):
    reward = _file(setup, "mine.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    preflight(setup.config("grpo", f"data.train_files=[{_mine(setup, 'mine.parquet')}]", f"reward.function={reward}:compute_score"))


def _step_dir(setup: Setup, files: dict[str, int] | None, algorithm: str = "grpo") -> Path:
    folder = setup.root / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    if files is not None:
        (folder / "COMPLETE.json").write_text(json.dumps({"step": 3, "files": files, "algorithm": algorithm}))
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_name_is_refused_before_anything_loads_naming_its_key(setup, case):
    algorithm, overrides, key, words = CASES[case]
    config = setup.config(algorithm, *overrides(setup))
    with pytest.raises(PreflightError) as info:
        make_trainer(config)
    [problem] = info.value.problems
    assert problem.startswith(f"{key}: ") and words in problem, problem
    assert isinstance(info.value, RLCoreError)
    if case != "output dir is a file":
        assert not setup.out.exists()  # refused before the recipe made its run folder


def test_every_problem_is_reported_at_once(setup):
    config = setup.config("grpo", f"model.path={setup.root / 'nope'}", f"reward.function={setup.root / 'r.py'}:f",
                          f"trainer.resume={setup.root / 'step_00000001'}")
    with pytest.raises(PreflightError) as info:
        preflight(config)
    assert [p.split(":")[0] for p in info.value.problems] == ["model.path", "reward.function", "trainer.resume"]
    assert str(info.value).startswith("3 problems with what the config names:\n  model.path: ")


def test_cli_prints_the_message_without_a_traceback_and_exits_2(setup, capsys):
    argv = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *setup.args(), f"model.path={setup.root / 'nope'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlcore: error: model.path: {setup.root / 'nope'} does not exist")
    assert "Traceback" not in err and err.count("\n") == 1

    for verbose in (["-v", *argv], [*argv[:2], "--verbose", *argv[2:]], [*argv, "-v"]):  # -v anywhere
        assert main(verbose) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "PreflightError" in err
        assert err.rstrip().splitlines()[-1].startswith("rlcore: error: model.path:")


def test_cli_reports_a_bad_row_found_by_the_loader_as_a_message(setup, capsys):
    """Rows are validated by the loaders (before any model loads): their errors print cleanly too."""
    bad = setup.root / "bad.jsonl"
    bad.write_bytes(json.dumps(rl_row()).encode() + b"\n" + json.dumps(rl_row("2+@=")).encode().replace(b"@", b"\xff") + b"\n")
    argv = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *setup.args(), f"data.train_files=[{bad}]"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{bad}: row 1: field 'prompt[0].content': not valid UTF-8: byte 0xff" in err


def test_cli_config_errors_keep_their_message(capsys):
    assert main(["train", str(CONFIG_DIR / "tiny_grpo.yaml"), "actor.optim.lrr=1", "model.path=m"]) == 2
    assert capsys.readouterr().err == "rlcore: error: invalid config: actor.optim.lrr: unknown key\n"


@pytest.mark.slow  # a fresh process importing torch (~10 CPU-s measured)
def test_rlcore_train_with_a_missing_model_path(setup):
    """The real command, in its own process: a one-line message and a non-zero exit."""
    args = [sys.executable, "-m", "rlcore.cli", "train", str(CONFIG_DIR / "tiny_grpo.yaml"), *setup.args(),
            f"model.path={setup.root / 'nope'}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=scaled(300), cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.startswith("rlcore: error: model.path:") and done.stderr.count("\n") == 1, done.stderr
    assert not setup.out.exists()
