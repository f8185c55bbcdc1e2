"""Hostile input to `rlcore plan` and to layouts, as an attacker or a careless user gives it:
absurd numbers, wrong types, deep nesting, non-UTF-8 bytes, empty strings. Every case must end
with exit status 2 and one line naming the argument, config key or file at fault (argparse's own
refusals: its usage, then one such line); none may hang or print a traceback.

The cases are generated from a fixed seed, a few hundred per entry point, and run in this process
through `rlcore.cli.main`: every refusal comes before any model is built (before torch loads, for
the hardware arguments), so a case takes milliseconds once torch is imported. Two real `rlcore
plan` processes check the same from the outside, in the usage the README shows (the overrides
after the options; `slow`: the full suite runs them).
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)
from transformers import GPT2Config, Qwen2Config

from rlcore.cli import main as cli_main
from rlcore.config import MAX_RANKS
from rlcore.flops import peak_flops_for
from rlcore.plan.hardware import MAX_DEVICES, MAX_DEVICES_PER_NODE
from rlcore.plan.model_json import MAX_CONFIG_BYTES, MAX_DEPTH, SIZE_BOUNDS
from rlcore.plan.roles import MAX_MICRO_BATCH_TOKENS

ROOT = Path(__file__).resolve().parents[1]
SEED = 38
CASE_BOUND_S = 60  # "never hangs": a refusal takes milliseconds; this only has to tell a hang from a slow machine
HARDWARE = ["--nodes", "1", "--devices-per-node", "8", "--device-memory", "80GiB"]

# Values no setting of a size or a count takes: absurd, negative, of the wrong type, empty.
ABSURD = [10**9, 10**12, 2**31, 2**63, 2**64 + 1, 10**40, 10**400]
WRONG_TYPES: list[Any] = [1e9, 2.0, 2.5, 1e308, math.nan, math.inf, -math.inf, True, False, "", " ", "2", "abc", "\x00",
                          "\udcff", "🙂" * 3, [2], [], {"a": 2}, {}]


def _deep(depth: int, kind: str = "dict") -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value} if kind == "dict" else [value]
    return value


@dataclass(frozen=True)
class Case:
    """One hostile input: the command line, and what its one line must name."""

    what: str
    argv: list[str]
    names: tuple[str, ...]


def _run(capfd: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int | str | None, str, float]:
    start = time.monotonic()
    try:
        code: int | str | None = cli_main(argv)
    except SystemExit as stop:  # argparse's refusals
        code = stop.code
    elapsed = time.monotonic() - start
    _, err = capfd.readouterr()
    return code, err, elapsed


def _problem(case: Case, code: int | str | None, err: str, elapsed: float) -> str | None:
    """Why `case` was not refused as it must be (None: it was)."""
    lines = err.strip().splitlines()
    if elapsed > CASE_BOUND_S:
        return f"took {elapsed:.0f} s"
    if "Traceback" in err or code != 2 or not lines:
        return f"exit {code}: {err[-2000:]!r}"
    if lines[0].startswith("usage: "):  # argparse: its usage, then the one line
        message = lines[-1]
        if not message.startswith(("rlcore: error: ", "rlcore plan: error: ")):
            return f"argparse's last line is not its error: {err!r}"
    elif len(lines) == 1 and lines[0].startswith("rlcore: error: "):
        message = lines[0]
    else:
        return f"not one line: {err!r}"
    missing = [name for name in case.names if name not in message]
    return f"the line does not name {missing}: {message!r}" if missing else None


def _all_refused(capfd: pytest.CaptureFixture[str], cases: list[Case]) -> None:
    failures = []
    for case in cases:
        problem = _problem(case, *_run(capfd, case.argv))
        if problem is not None:
            failures.append(f"{case.what} ({case.argv[-6:]!r}): {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} cases not refused as they must be:\n" + "\n".join(failures[:20])


# ----- a run to plan ------------------------------------------------------------------------------


def _model_config() -> dict[str, Any]:
    """A small Qwen2's config.json (grouped-query attention: 4 heads, 2 key/value heads)."""
    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True).to_dict()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Callable[[str, bytes], Path]]]:
    """A GRPO config planning a small model (`model.path`: a folder with its config.json alone),
    and a maker of model folders holding a given config.json."""
    root = tmp_path_factory.mktemp("plan_hostile")
    count = iter(range(10**6))

    def folder(name: str, config_json: bytes) -> Path:
        path = root / f"{next(count):04d}-{name}"
        path.mkdir()
        (path / "config.json").write_bytes(config_json)
        return path

    model = folder("valid", json.dumps(_model_config()).encode())
    config = root / "grpo.yaml"
    config.write_text(f"""
model: {{path: {model}, dtype: bfloat16}}
data: {{train_files: [unused.parquet], max_prompt_length: 32, train_batch_size: 4}}
actor: {{ppo_mini_batch_size: 4, max_tokens_per_micro_batch: 256, use_kl_loss: true}}
rollout: {{n: 4, max_new_tokens: 32, backend: vllm}}
""")
    yield config, folder


# ----- rlcore plan: its arguments -----------------------------------------------------------------


def _not_ints(rng: random.Random) -> list[str]:
    """Texts that are no integer (argparse refuses them naming the flag)."""
    return ["", " ", "abc", "1e9", "1.5", "0x10", "٣", "\udcff", "9" * 5000, "--", "1 2", rng.choice(["nan", "inf"]),
            "".join(rng.choice("0123456789.e+-") for _ in range(rng.randint(2, 12))).strip("0123456789") + "x"]


def _hardware_cases(config: Path, rng: random.Random) -> list[Case]:
    flags: dict[str, list[str]] = {
        "--nodes": [str(v) for v in (0, -1, -(10**9), MAX_DEVICES // 8 + 1, *ABSURD)] + _not_ints(rng),
        "--devices-per-node": [str(v) for v in (0, -8, MAX_DEVICES_PER_NODE + 1, *ABSURD)] + _not_ints(rng),
        "--device-memory": ["0", "0.1", "-1GiB", "80 gigs", "80GIGS", "1e9", "", " ", "GiB", "2PiB", "1048577GiB", "9" * 401,
                            "9" * 100_000, "80GiB!", "\udcff", "٣GiB", "80GiB\x00", "nan", "inf", ".", "1..5GiB"],
        "--headroom": ["1", "100%", "150%", "-1%", "-0.5", "nan", "inf", "-inf", "", "%", "abc", "1e400", "9" * 5000, "\udcff",
                       "10%%"],
        "--tensor-parallel": [str(v) for v in (0, -1, 3, 5, 6, 7, 9, 16, 2**40)] + ["abc", "1.0", "", "\udcff"],
    }
    cases = []
    for _ in range(260):
        flag = rng.choice([*flags, "--device"])
        if flag == "--device":  # a name no known peak is found in
            value = "".join(rng.choice("abcdefgXYZ0123456789 -_\udcff") for _ in range(rng.randint(0, 40)))
            if peak_flops_for(value) is not None:
                continue
        else:
            value = rng.choice(flags[flag])
        hardware = dict(zip(HARDWARE[::2], HARDWARE[1::2]))
        hardware[flag] = value
        options = [part for item in hardware.items() for part in item]
        override = ["rollout.n=4"]  # a valid override, before or after the options (both are the usage)
        argv = ["plan", str(config), *(override + options if rng.random() < 0.5 else options + override)]
        cases.append(Case(f"{flag} {value[:40]!r}", argv, (flag,)))
    return cases


def test_hostile_plan_arguments_are_refused_naming_the_argument(run, capfd):
    config, _ = run
    cases = _hardware_cases(config, random.Random(SEED))
    assert len(cases) >= 200
    _all_refused(capfd, cases)


def test_the_usage_the_help_shows_works_overrides_after_the_options(run, capfd):
    """`rlcore plan CONFIG --nodes N --devices-per-node G --device-memory 80GiB [dotted.key=value ...]`:
    the override after the options is applied (here: it points at a folder without config.json);
    an option after them is still an option; `rlcore train` and `rlcore sft` keep refusing an
    unknown option."""
    config, _ = run
    code, err, _ = _run(capfd, ["plan", str(config), "--nodes", "2", "--devices-per-node", "8", "--device-memory", "80GiB",
                                "model.path=/nowhere", "rollout.n=2"])
    assert code == 2 and err == "rlcore: error: model.path: /nowhere has no config.json (the planner needs only that file, " \
                                "no weights)\n"
    code, err, _ = _run(capfd, ["plan", str(config), "model.path=/nowhere", "--device-memory", "80GiB", "--nodes", "0"])
    assert code == 2 and "--nodes 0" in err  # the hardware is checked first, wherever the options stand
    for command in ("train", "sft"):
        code, err, _ = _run(capfd, [command, str(config), "a.b=1", "--nodes", "2"])
        assert code == 2 and err.strip().splitlines()[-1] == "rlcore: error: unrecognized arguments: --nodes 2"
    code, err, _ = _run(capfd, ["plan", str(config), "--device-memory", "80GiB", "--nodez", "2"])
    assert code == 2 and "unrecognized arguments: --nodez 2" in err


def test_pipeline_commands_take_overrides_after_their_options_too():
    from rlcore.cli import parse_args

    for command in ("run", "serve"):
        args = parse_args(["pipeline", command, "trainer.total_steps=2", "--output-dir", "w", "actor.optim.lr=1e-5"])
        assert args.overrides == ["trainer.total_steps=2", "actor.optim.lr=1e-5"] and args.output_dir == "w"


# ----- rlcore plan: the model's config.json -------------------------------------------------------


def _config_json_cases(config: Path, folder: Callable[[str, bytes], Path], rng: random.Random) -> list[Case]:
    valid = _model_config()
    text = json.dumps(valid)
    files: list[tuple[str, bytes, tuple[str, ...]]] = [  # (what, the file's bytes, what the line names besides the folder)
        ("empty", b"", ()), ("blank", b"  \n\t", ()), ("UTF-16", text.encode("utf-16"), ()),
        ("BOM", b"\xef\xbb\xbf" + text.encode(), ()), ("a non-UTF-8 byte", text.replace('"qwen2"', '"qwen\udcff2"').encode(
            "utf-8", "surrogateescape"), ()),
        ("a 5,000-digit number", text.replace('"num_hidden_layers": 2', '"num_hidden_layers": ' + "9" * 5000).encode(), ()),
        (f"over {MAX_CONFIG_BYTES} bytes", b" " * (MAX_CONFIG_BYTES + 1) + b"{}", ()),
    ]
    files += [(f"JSON {value}", value.encode(), ()) for value in ("[]", "1", "null", '"x"', "true", "[{}]", "{", "}")]
    files += [(f"{rng.randint(1, 4000)} random bytes", b"\xff" + rng.randbytes(rng.randint(0, 4000)), ()) for _ in range(8)]
    files += [("cut short", text[:rng.randint(1, len(text) - 2)].encode(), ()) for _ in range(8)]
    for depth in (MAX_DEPTH + 1, 100, 1000, 5000, 100_000):
        for kind in ("dict", "list"):
            files.append((f"{kind} nested {depth} deep at the top", json.dumps(_deep(depth, kind)).encode() if depth < 900 else
                          (("[" * depth + "]" * depth) if kind == "list" else '{"a":' * depth + "1" + "}" * depth).encode(), ()))
            nested = ("[" * depth + "]" * depth) if kind == "list" else '{"a":' * depth + "1" + "}" * depth
            files.append((f"rope_scaling nested {depth} deep", text.replace('"rope_parameters": ', f'"rope_scaling": {nested}, '
                                                                                                  '"rope_parameters": ').encode(), ()))
    # one key at a time: the sizes the planner builds from, the names transformers needs
    for _ in range(180):
        name = rng.choice(list(SIZE_BOUNDS))
        bound = SIZE_BOUNDS[name]
        value = rng.choice([bound.high + 1, *ABSURD, bound.low - 1, -1, -(10**400), *WRONG_TYPES, _deep(rng.randint(2, 60))])
        files.append((f"{name}={str(value)[:30]}", json.dumps({**valid, name: value}).encode(), (name,)))
    for value in ("", "  ", 5, None, [], {}, "no_such_architecture", "\udcff", "qwen2" * 1000):
        files.append((f"model_type={str(value)[:30]!r}", json.dumps({**valid, "model_type": value}).encode(), ("model_type",)))
    files.append(("no model_type", json.dumps({k: v for k, v in valid.items() if k != "model_type"}).encode(), ("model_type",)))
    for value in ("x", 5, [1], {"a": 1}):
        files.append((f"architectures={value!r}", json.dumps({**valid, "architectures": value}).encode(), ("architectures",)))
        files.append((f"text_config={value!r}", json.dumps({**valid, "text_config": value}).encode(), ("text_config",)))
    files.append(("text_config with a billion layers", json.dumps({"model_type": "qwen2", "text_config": {
        **valid, "num_hidden_layers": 10**9}}).encode(), ("text_config.num_hidden_layers",)))
    files.append(("3 key/value heads for 4 heads", json.dumps({**valid, "num_key_value_heads": 3}).encode(),
                  ("num_key_value_heads",)))
    files.append(("heads without dimensions", json.dumps({**valid, "hidden_size": 2}).encode(), ("hidden_size",)))
    # wrong types transformers' own config classes refuse, naming the field
    for name, value in (("rms_norm_eps", "x"), ("tie_word_embeddings", "yes"), ("rope_parameters", [1]), ("layer_types", 5),
                        ("layer_types", ["x", "y"]), ("max_window_layers", "x"), ("pad_token_id", "x"), ("hidden_act", 5)):
        files.append((f"{name}={value!r}", json.dumps({**valid, name: value}).encode(), (name,)))
    files.append(("an unknown activation", json.dumps({**valid, "hidden_act": "nope"}).encode(), ()))
    # architectures the planner does not take (decoder layers elsewhere), with absurd sizes in their own spelling
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0).to_dict()
    files.append(("GPT-2", json.dumps(gpt2).encode(), ("GPT2LMHeadModel", "not supported", "Llama")))
    files.append(("GPT-2 of a billion layers", json.dumps({**gpt2, "n_layer": 10**9}).encode(), ("n_layer",)))
    cases = []
    for what, data, names in files:
        model = folder(re.sub(r"[^A-Za-z0-9_]", "", what.split()[0])[:30] or "case", data)
        argv = ["plan", str(config), *HARDWARE, f"model.path={model}"]  # the override after the options, as the usage shows
        cases.append(Case(f"config.json: {what}", argv, ("model.path", str(model), *names)))
    return cases


def test_hostile_model_config_json_is_refused_naming_the_file_and_key(run, capfd):
    config, folder = run
    cases = _config_json_cases(config, folder, random.Random(SEED))
    assert len(cases) >= 250
    _all_refused(capfd, cases)


def test_the_critics_and_reward_models_config_json_are_named_by_their_own_keys(run, capfd):
    config, folder = run
    deep = folder("deep", ("[" * 50_000 + "]" * 50_000).encode())
    layers = folder("layers", json.dumps({**_model_config(), "num_hidden_layers": 10**9}).encode())
    cases = [Case("critic", ["plan", str(config), *HARDWARE, "algorithm.name=ppo", "algorithm.adv_estimator=gae",
                             f"critic.model_path={model}"], ("critic.model_path", str(model))) for model in (deep, layers)]
    cases += [Case("reward model", ["plan", str(config), *HARDWARE, f"reward_model.path={model}"],
                   ("reward_model.path", str(model))) for model in (deep, layers)]
    _all_refused(capfd, cases)


# ----- rlcore plan: the run's sizes ---------------------------------------------------------------


def test_absurd_sequence_and_micro_batch_sizes_are_refused_before_any_model_is_built(run, capfd):
    config, _ = run
    rng = random.Random(SEED)
    cases = []
    for _ in range(20):
        huge = rng.choice([MAX_MICRO_BATCH_TOKENS + 1, 10**9, 2**62, 10**40])
        key = rng.choice(["data.max_prompt_length", "rollout.max_new_tokens"])
        cases.append(Case(f"{key}={huge}", ["plan", str(config), *HARDWARE, f"{key}={huge}"], (key,)))
    rows = 2**19  # 2^19 rows of 64 tokens: 2^25 tokens in one micro-batch
    cases.append(Case("micro-batch", ["plan", str(config), *HARDWARE, "actor.dynamic_batch_size=false",
                                      f"actor.micro_batch_size={10**12}", f"data.train_batch_size={rows}",
                                      f"actor.ppo_mini_batch_size={rows}"], ("actor.micro_batch_size",)))
    _all_refused(capfd, cases)


# ----- layouts ------------------------------------------------------------------------------------

LAYOUT_BASE = {"model": {"path": "m"}, "data": {"train_files": ["t.parquet"]}, "trainer": {"backend": "ray"},
               "algorithm": {"name": "ppo", "adv_estimator": "gae"}, "actor": {"use_kl_loss": True},
               "reward_model": {"path": "rm"}, "rollout": {"backend": "vllm"}}
ROLES = ("actor", "ref", "critic", "reward_model", "rollout")
PARTS = ("data_parallel", "sequence_parallel", "tensor_parallel")


def _bad_count(rng: random.Random) -> Any:
    """A value no rank count takes: absurd, zero or negative, of the wrong type (floats and bools
    included: 2.0 or true is not a count), deeply nested."""
    return rng.choice([0, -1, -(10**400), MAX_RANKS + 1, *ABSURD, *WRONG_TYPES, None, b"\xff\xfe", _deep(rng.randint(2, 50)),
                       _deep(rng.randint(2, 50), "list")])


def _layout_cases(root: Path, rng: random.Random) -> list[Case]:
    cases = []
    for i in range(300):
        role = rng.choice(ROLES)
        form = rng.choice(["part", "part", "part", "layout", "unknown", "product", "legacy"])
        tree = json.loads(json.dumps(LAYOUT_BASE))
        tree.setdefault("critic", {})
        tree.setdefault("ref", {})
        section = tree[role]
        if form == "part":
            part = rng.choice(PARTS)
            section["layout"] = {part: _bad_count(rng)}
            key = f"{role}.layout.{part}"
        elif form == "layout":  # not a mapping of the three
            section["layout"] = rng.choice([v for v in (0, -1, 10**400, *WRONG_TYPES, b"\xff") if not isinstance(v, dict)])
            key = f"{role}.layout"
        elif form == "unknown":
            name = rng.choice(["pipeline_parallel", "", "data_parallel ", "DATA_PARALLEL", "\udcff", "x" * 300])
            section["layout"] = {name: 2}
            key = f"{role}.layout"
        elif form == "product":  # every part a count, their product more ranks than any cluster
            sizes = [rng.randint(2**7, 2**10) for _ in PARTS]
            section["layout"] = dict(zip(PARTS, sizes))
            key = f"{role}.layout"
        else:  # the keys a layout replaces (the reference has none: it is the actor's)
            role = "actor" if role == "ref" else role
            name = rng.choice(["world_size", "ulysses_sequence_parallel_size"] if role == "actor" else ["world_size"])
            tree[role][name] = _bad_count(rng)
            key = f"{role}.{name}"
        path = root / f"layout-{i:03d}.yaml"
        path.write_text(yaml.safe_dump(tree))
        cases.append(Case(f"{form} {key}", ["train", str(path)], (key,)))
    return cases


def test_hostile_layouts_are_refused_at_load_naming_the_key(tmp_path, capfd):
    """Through `rlcore train` (its config is loaded first, before anything trains)."""
    cases = _layout_cases(tmp_path, random.Random(SEED))
    _all_refused(capfd, cases)
    # and as dotted overrides on the command line
    overrides = [("actor.layout.tensor_parallel=1.0e9", "actor.layout.tensor_parallel"),
                 ("actor.layout={data_parallel: 2.0}", "actor.layout.data_parallel"),
                 ("actor.layout.sequence_parallel=true", "actor.layout.sequence_parallel"),
                 ("actor.layout.data_parallel='4'", "actor.layout.data_parallel"),
                 (f"rollout.layout.data_parallel={10**400}", "rollout.layout.data_parallel"),
                 ("critic.layout=[2, 2]", "critic.layout"),
                 ("actor.world_size=1e9", "actor.world_size"), ("actor.layout.data_parallel=", "actor.layout.data_parallel")]
    clean = tmp_path / "clean.yaml"
    clean.write_text(yaml.safe_dump(LAYOUT_BASE))
    _all_refused(capfd, [Case(text, ["train", str(clean), text], (key,)) for text, key in overrides])


# ----- real processes -----------------------------------------------------------------------------


def _rlcore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlcore.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(300))


# Two real processes; the same refusals in process: test_hostile_plan_arguments_are_refused_naming_the_argument
# (the 401-digit --device-memory) and test_hostile_model_config_json_is_refused_naming_the_file_and_key (a billion
# layers).
@pytest.mark.slow
def test_rlcore_plan_refuses_in_one_line_as_a_process(run):
    """The README's usage (overrides after the options) with a 401-digit memory size, and with a
    config.json of a billion layers (the planner used to build them, and never returned)."""
    config, folder = run
    done = _rlcore("plan", str(config), "--nodes", "2", "--devices-per-node", "8", "--device-memory", "9" * 401, "rollout.n=2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("rlcore: error: --device-memory: '99999") and "more than 1 PiB" in done.stderr
    layers = folder("billion", json.dumps({**_model_config(), "num_hidden_layers": 10**9}).encode())
    done = _rlcore("plan", str(config), "--nodes", "2", "--devices-per-node", "8", "--device-memory", "80GiB",
                   f"model.path={layers}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == (f"rlcore: error: model.path: {layers / 'config.json'}: num_hidden_layers=1000000000 is more than "
                           "1,024, beyond any real model (released decoder models have fewer than 200 layers); refused "
                           "before any model is built\n")
