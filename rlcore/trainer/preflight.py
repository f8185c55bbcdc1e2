"""Check every name a config resolves before anything expensive starts.

`rlcore.config` already refuses unknown keys, bad values and unknown registry names (estimators,
losses, KL types) at load. What it cannot know is whether the things the config *points at* are
there and usable: the model folder, the data files, the reward function (or a built-in scorer for
every data source the data holds), the checkpoint to resume, the critic's model. Without this,
each of those failed only after the models loaded and a generation ran, behind a traceback from
the library that tripped over it ("Repo id must be in the form..." for a missing model folder),
or, for a data source nothing scores, not at all: every sample scored 0 and the run trained on
nothing. `preflight` checks them all in one pass, with file-level reads only (no model, no
tokenizer; of the data, the schema and the data_source column; the loaders validate every row
before any model loads), and reports every problem at once, each naming its config key.

`rlcore.trainer.run.make_trainer` calls it first, so `rlcore train`, the pipeline and any script
that builds a trainer get it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlcore.algorithms import DataKind
from rlcore.checkpoint import MANIFEST, CheckpointError, step_of
from rlcore.config import Config, SFTConfig, sft_actor_spec
from rlcore.data import RL_FIELDS, DatasetError, peek_fields, read_column
from rlcore.data.preference import PREFERENCE_FIELDS
from rlcore.errors import RLCoreError
from rlcore.rewards.registry import RewardFunctionError, SpecError, builtin_data_sources, resolve_spec
from rlcore.rewards.tools import load_tools, tool_schemas
from rlcore.rewards.user_code import describe
from rlcore.rollout_backends import traits_of as backend_traits
from rlcore.trainer.model_folders import read_model_config, reward_model_config_problems, weight_problems
from rlcore.workers.parallel.shapes import layout_problems, role_layout_problems

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


class PreflightError(RLCoreError):
    """What the config points at cannot be used; `.problems` holds one line per problem, each
    starting with its config key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems with what the config names:\n  " + "\n  ".join(self.problems)
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # keep `.problems` through pickling (Ray, Prefect results)
        return (PreflightError, (self.problems,))


def preflight(config: Config) -> None:
    """Raise `PreflightError` listing every config key whose target is missing or unusable."""
    start = time.perf_counter()
    problems = preflight_problems(config)
    log.info("preflight: %d problem(s), %.3f s", len(problems), time.perf_counter() - start)
    if problems:
        raise PreflightError(problems)


def preflight_problems(config: Config) -> list[str]:
    """Every problem found, one line each, starting with the config key."""
    traits = config.traits
    problems = model_folder_problems("model.path", config.model.path, tokenizer=True)
    if traits.critic and config.critic.model_path is not None:
        problems += model_folder_problems("critic.model_path", config.critic.model_path, tokenizer=False)
    if config.reward_model.path is not None:
        problems += reward_model_problems("reward_model.path", config.reward_model.path)
    if "reward_model" in traits.trains and not problems:  # the reward model to train renders with model.path's template
        problems += chat_template_problems("model.path", config.model.path)
    problems += layout_problems(config)
    problems += data_problems(config)
    problems += reward_problems(config.reward.function)
    problems += scorer_problems(config)
    problems += agent_problems(config)
    problems += resume_problems(config.trainer.resume, config.algorithm.name)
    problems += output_dir_problems(config.trainer.output_dir)
    return problems


def model_folder_problems(key: str, path: str, *, tokenizer: bool) -> list[str]:
    """A local Hugging Face model folder: config.json naming a model type that transformers reads,
    weights whose files are whole and whose small tensors are finite (`model_folders`), and (for
    the policy, whose folder the tokenizer is loaded from) a tokenizer. The policy's folder is
    also the reference model's."""
    folder = Path(path)
    what = f"a local Hugging Face model folder with config.json, weights{' and a tokenizer' if tokenizer else ''}; " \
           "models are never downloaded"
    if not folder.exists():
        return [f"{key}: {path} does not exist (expected {what})"]
    if not folder.is_dir():
        return [f"{key}: {path} is not a folder (expected {what})"]
    problems = []
    config_file = folder / "config.json"
    if not config_file.is_file():
        problems.append(f"{key}: {path} has no config.json (expected {what})")
    else:
        try:
            model_config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            problems.append(f"{key}: {config_file} is not readable JSON ({err})")
        else:
            if not isinstance(model_config, dict) or "model_type" not in model_config:
                problems.append(f"{key}: {config_file} names no model_type (not a transformers model config)")
            else:
                problems += read_model_config(key, folder)[1]
    if not any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS):
        problems.append(f"{key}: {path} holds no weights (*.safetensors or pytorch_model*.bin)")
    problems += weight_problems(key, folder)
    if tokenizer:
        present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        if not present:
            problems.append(f"{key}: {path} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); "
                            f"the tokenizer is loaded from {key}")
        if "tokenizer_config.json" in present:
            try:
                json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                problems.append(f"{key}: {folder / 'tokenizer_config.json'} is not readable JSON ({err})")
        if "tokenizer.json" in present and (folder / "tokenizer.json").stat().st_size == 0:
            problems.append(f"{key}: {folder / 'tokenizer.json'} is empty")
    return problems


def reward_model_problems(key: str, path: str) -> list[str]:
    """A trained reward model folder: a Hugging Face model folder with a tokenizer whose config
    names a one-label sequence classifier, and a chat template to render conversations with."""
    problems = model_folder_problems(key, path, tokenizer=True)
    folder = Path(path)
    if problems or not (folder / "config.json").is_file():
        return problems
    model_config, unreadable = read_model_config(key, folder)
    if model_config is None:
        return unreadable
    return reward_model_config_problems(key, folder, model_config) + chat_template_problems(key, path)


def chat_template_problems(key: str, path: str) -> list[str]:
    """A reward model renders whole conversations with its tokenizer's chat template: the folder
    must carry one (chat_template.jinja / .json, or `chat_template` in tokenizer_config.json)."""
    folder = Path(path)
    tok_config = folder / "tokenizer_config.json"
    templated = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file()
    if not templated and tok_config.is_file():
        try:
            templated = bool(json.loads(tok_config.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError):
            templated = True  # reported by model_folder_problems
    if templated or not folder.is_dir():
        return []
    return [f"{key}: the tokenizer in {path} has no chat template (chat_template.jinja or chat_template in "
            "tokenizer_config.json); a reward model scores conversations rendered with its own template"]


def data_problems(config: Config) -> list[str]:
    """Each data file the run reads: there, readable, in a known format, with the fields its rows need."""
    traits = config.traits
    lists = [("data.train_files", config.data.train_files, [DATA_FIELDS[traits.data]]),
             ("data.val_files", config.data.val_files, [DATA_FIELDS[kind] for kind in traits.val_data])]
    if traits.task_validation:
        lists.append(("preference.task_val_files", config.preference.task_val_files, [RL_FIELDS]))
    problems = [] if config.data.train_files else ["data.train_files: empty (give at least one .parquet or .jsonl file)"]
    for key, files, needed in lists:
        for i, file in enumerate(files):
            problem = data_file_problem(f"{key}[{i}]", file, needed)
            if problem is not None:
                problems.append(problem)
    return problems


# The fields a file of each kind of rows must have (an SFT file's depend on its config: see sft_preflight).
DATA_FIELDS: dict[DataKind, tuple[str, ...]] = {
    "prompts": RL_FIELDS, "pairwise": PREFERENCE_FIELDS["pairwise"], "unpaired": PREFERENCE_FIELDS["unpaired"],
}


def data_file_problem(key: str, file: str, needed: list[tuple[str, ...]]) -> str | None:
    """None when `file` is readable and has every field of one of the `needed` sets."""
    try:
        fields = peek_fields(file)
    except DatasetError as err:
        return f"{key}: {err}"
    if any(all(name in fields for name in required) for required in needed):
        return None
    if len(needed) == 1:
        missing = [name for name in needed[0] if name not in fields]
        return (f"{key}: {file} lacks the field(s) {', '.join(missing)} (it has {', '.join(fields)}; "
                f"rows here need {', '.join(needed[0])})")
    wanted = " or ".join(f"({', '.join(required)})" for required in needed)
    return f"{key}: {file} has the fields {', '.join(fields)}; rows here need {wanted}"


def reward_problems(spec: str | None) -> list[str]:
    """`reward.function` importable (a module) or existing and running (a .py file), and
    defining the function; None (the built-in scorers) needs nothing."""
    if spec is None:
        return []
    try:
        describe([str(resolve_spec(spec))], "reward function", RewardFunctionError, schemas=False)
    except SpecError as err:
        return [f"reward.function: {str(err).removeprefix('reward function spec ')}"]
    return []


def agent_problems(config: Config) -> list[str]:
    """Each `rollout.agent.tools` entry loads and has a schema, no two share a name, and the
    interaction factory loads (user code is loaded in a child interpreter, `user_code.describe`)."""
    agent = config.rollout.agent
    problems = tool_spec_problems("rollout.agent.tools", agent.tools, load_tools)
    if agent.interaction is not None:
        try:
            describe([str(resolve_spec(agent.interaction))], "interaction", SpecError, schemas=False)
        except SpecError as err:
            problems.append(f"rollout.agent.interaction: {str(err).removeprefix('interaction spec ')}")
    if agent.enabled:
        problems += agent_length_problems(config)
    return problems


def tool_spec_problems(key: str, specs: Sequence[str], load: Callable[[Sequence[str]], Any] = tool_schemas) -> list[str]:
    """Each tool spec under `key` loads by `load` (`load_tools` where the tools run, RL's agent;
    `tool_schemas` where only their schemas are rendered, SFT, which also reads .json schema files)
    and no two tools share a name."""
    problems = []
    for i, spec in enumerate(specs):
        try:
            load([spec])
        except Exception as err:  # noqa: BLE001 - user code may raise anything while it is imported
            problems.append(f"{key}[{i}]: {str(err).removeprefix('tool spec ')}")
    if not problems and len(specs) > 1:
        try:
            load(specs)
        except Exception as err:  # noqa: BLE001
            problems.append(f"{key}: {str(err).removeprefix('tool spec ')}")
    return problems


def _dotted(config: Config, key: str) -> Any:
    """The value of a dotted config key (`rollout.vllm.max_model_len`)."""
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def agent_length_problems(config: Config) -> list[str]:
    """A trajectory must fit the model: the longest prompt plus `max_total_tokens` within its
    positions (and the rollout engine's own limit, its backend's `context_limit_key`: vLLM's
    `max_model_len`), else the run would fail mid-rollout."""
    try:
        model_config = json.loads((Path(config.model.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # model_folder_problems names the folder
    text = model_config.get("text_config", model_config) if isinstance(model_config, dict) else {}
    limits = [("the model's max_position_embeddings", text.get("max_position_embeddings"))]
    key = backend_traits(config.rollout.backend).context_limit_key
    if key is not None:
        limits.append((key, _dotted(config, key)))
    need = config.data.max_prompt_length + config.rollout.agent.max_total_tokens
    return [f"rollout.agent.max_total_tokens: data.max_prompt_length ({config.data.max_prompt_length}) + "
            f"rollout.agent.max_total_tokens ({config.rollout.agent.max_total_tokens}) = {need} tokens exceeds {what} ({limit})"
            for what, limit in limits if isinstance(limit, int) and need > limit]


def scorer_problems(config: Config) -> list[str]:
    """Without `reward.function`, every `data_source` in the run's RL-schema data must have a
    built-in scorer: otherwise each of its samples would score `reward.error_score` and the run
    would train on nothing. Reads the `data_source` column only; one line per unknown source. A
    value that is not a string (an integer column, say) is named with its type and first rows,
    unless `data.on_bad_row: skip`, which drops (and counts) those rows when the data loads."""
    if config.reward.function is not None:
        return []
    problems: list[str] = []
    sources: dict[str, str] = {}
    for key, file in rl_schema_files(config):
        try:
            if not all(name in peek_fields(file) for name in RL_FIELDS):
                continue  # data_problems names what the file lacks
            values = read_column(file, "data_source")
        except DatasetError:
            continue  # data_problems names the file
        bad = [(row, value) for row, value in enumerate(values) if value is not None and not isinstance(value, str)]
        if bad and config.data.on_bad_row == "error":
            problems.append(column_type_problem(key, file, "data_source", bad, "a non-empty string (the scorer's name)"))
        for source in sorted({v for v in values if isinstance(v, str)}):
            sources.setdefault(source, key)
    known = set(builtin_data_sources())
    return problems + [
        f"reward.function: not set, and data_source {source!r} ({key}) has no built-in scorer (built-in: "
        f"{', '.join(sorted(known))}); give yours as reward.function: 'path/to/file.py:compute_score' or "
        f"'module:function', called as compute_score(data_source, solution_str, ground_truth, extra_info) (verl's "
        f"signature), returning a number or a dict with a 'score'"
        for source, key in sources.items() if source not in known]


def column_type_problem(key: str, file: str, column: str, bad: list[tuple[int, Any]], expected: str) -> str:
    """One line: the file's column holds values of the wrong type, which types, and the first rows."""
    types = sorted({type(value).__name__ for _, value in bad})
    first = ", ".join(f"{row} ({type(value).__name__} {value!r:.40})" for row, value in bad[:3])
    return (f"{key}: {file}: column '{column}' holds {'/'.join(types)} values where {expected} is expected, in "
            f"{len(bad)} row(s), first rows {first}; write them as strings, or set data.on_bad_row=skip to skip "
            "such rows (counted)")


def rl_schema_files(config: Config) -> list[tuple[str, str]]:
    """(config key, file) of the data whose rows are scored by the reward: RL prompts (GRPO, PPO),
    or the preference runs' task validation prompts (a reward model's training run scores none)."""
    traits = config.traits
    keyed = []
    if traits.data == "prompts":
        keyed += [(f"data.train_files[{i}]", f) for i, f in enumerate(config.data.train_files)]
    if "prompts" in traits.val_data:
        keyed += [(f"data.val_files[{i}]", f) for i, f in enumerate(config.data.val_files)]
    if traits.task_validation:
        keyed += [(f"preference.task_val_files[{i}]", f) for i, f in enumerate(config.preference.task_val_files)]
    return keyed


def resume_problems(resume: str, algorithm: str) -> list[str]:
    """An explicit `trainer.resume` path: a complete checkpoint folder of this algorithm (every
    file its manifest lists, at its size; the full SHA-256 check runs at the resume itself)."""
    if resume in ("auto", "disable"):
        return []
    path = Path(resume)
    what = "expected 'auto', 'disable' or a checkpoint folder step_XXXXXXXX holding COMPLETE.json"
    if not path.exists():
        return [f"trainer.resume: {resume} does not exist ({what})"]
    try:
        step_of(path)
    except CheckpointError:
        return [f"trainer.resume: {resume} is not a checkpoint folder ({what})"]
    if not path.is_dir():
        return [f"trainer.resume: {resume} is not a folder ({what})"]
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return [f"trainer.resume: {resume} is incomplete: no {MANIFEST} (its save did not finish)"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"trainer.resume: {resume}: unreadable {MANIFEST} ({err})"]
    for rel, expected in files.items():
        file = path / rel
        size = expected["size"] if isinstance(expected, dict) else expected
        if not file.is_file():
            return [f"trainer.resume: {resume} is incomplete: missing file {rel}"]
        if file.stat().st_size != size:
            return [f"trainer.resume: {resume}: file {rel} has {file.stat().st_size} bytes, {MANIFEST} says {size}"]
    saved = manifest.get("algorithm")
    if saved is not None and saved != algorithm:
        return [f"trainer.resume: {resume} is a {saved} checkpoint; this run is algorithm.name={algorithm}"]
    return []


def sft_preflight(config: SFTConfig) -> None:
    """`preflight` for an SFT run (`rlcore sft`): the model folder (and whether the actor's tensor-
    parallel size splits it), the data files (a messages column, or prompt and response columns),
    the checkpoint to resume and the output folder."""
    problems = model_folder_problems("model.path", config.model.path, tokenizer=True)
    actor = sft_actor_spec(config, 1)  # the layout the actor worker takes (total_steps plays no part in it)
    layout = actor.layout
    if layout.tensor_parallel > 1 or layout.sequence_parallel > 1:
        try:  # an unreadable folder is model_folder_problems' to report
            model_config = json.loads((Path(config.model.path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            model_config = None
        if isinstance(model_config, dict):
            problems += role_layout_problems(model_config, layout, actor.tp_key, actor.sp_key, config.model.path)
    data = config.data
    problems += [] if data.train_files else ["data.train_files: empty (give at least one .parquet or .jsonl file)"]
    needed = [(data.messages_key,), (data.prompt_key, data.response_key)]
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for i, file in enumerate(files):
            problem = data_file_problem(f"{key}[{i}]", file, needed)
            if problem is not None:
                problems.append(problem)
    problems += tool_spec_problems("data.tools", data.tools)
    problems += [p.replace("this run is algorithm.name=sft", "this is an SFT run")
                 for p in resume_problems(config.trainer.resume, "sft")]
    problems += output_dir_problems(config.trainer.output_dir)
    if problems:
        raise PreflightError(problems)


def output_dir_problems(output_dir: str) -> list[str]:
    """`trainer.output_dir` is a folder, or can be made one."""
    path = Path(output_dir)
    if path.exists():
        if not path.is_dir():
            return [f"trainer.output_dir: {output_dir} exists and is not a folder"]
        if not os.access(path, os.W_OK | os.X_OK):
            return [f"trainer.output_dir: {output_dir} is not writable"]
        return []
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return [f"trainer.output_dir: cannot create {output_dir}: {parent} is not a writable folder"]
    return []


__all__ = ["PreflightError", "preflight", "preflight_problems", "sft_preflight"]
