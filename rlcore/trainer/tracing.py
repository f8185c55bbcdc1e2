"""Following a sample through a step: request ids, the worker that did each phase, trace.jsonl.

Cheap by design: ranks are re-derived from each method's dispatch rule (a pure function of the
batch), not reported back by the workers.

What a person debugging a run reads: for `trainer.trace_samples` trajectories per step (evenly
spread over the batch), the conversation itself: the prompt, the model's text of every turn, each
tool call's name, arguments and result (or, without an agent, the response), each text with its
secrets redacted (`rlcore.redact`'s policy: credentials in URLs, API keys and tokens in known
formats, the values of secret environment variables, values under secret-looking keys, and those
values wherever else they appear in the record, such as the model's text of the call) and cut to
`trainer.trace_max_chars`; every other string of a record (a tool's error) is redacted too. The
other samples keep their ids, ranks, reward and per-turn counts only. `rlcore trace RUN_DIR` prints one
(`format_trajectory`).

Validation is recorded the same way in val_trace.jsonl beside it (so trace.jsonl keeps one record
per training step), one record per validation marked `"validation": true` with the step it ran
after (0: before training): every validation sample, with the facts of its episode that the
`val/agent/*` numbers are means of, and `trainer.trace_samples` of them with their conversation
(`validation_record`; `rlcore trace RUN_DIR --validation`).

Reading it back (`read_trace`) never raises on what a line holds: a line that is not a step record
(cut short by a killed run, not UTF-8, not JSON, nested too deep, of another shape) is skipped and
named with its line number; what was asked and cannot be shown is a `TraceError` naming the file
and line.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rlcore.chat import nesting_depth
from rlcore.controller import Dispatch, RoleView
from rlcore.controller.dispatch import balanced_partitions
from rlcore.errors import RLCoreError
from rlcore.protocol import Batch
from rlcore.redact import REDACTED, is_secret_key, redact_text, redact_tree
from rlcore.trainer.metrics import episode_facts

log = logging.getLogger(__name__)

# Which role does the work of each timed phase (trace.jsonl names the worker with its timing).
PHASE_ROLES = {
    "generate": "rollout", "rollout_sleep": "rollout", "rollout_wake": "rollout", "reward": "reward",
    "old_log_prob": "actor", "ref_log_prob": "ref", "values": "critic", "advantage": "controller",
    "update_critic": "critic", "update_actor": "actor", "weight_sync": "actor+rollout",
    "baseline_generate": "rollout", "baseline_reward": "reward", "reward_model": "reward_model",
}


def worker_identities(groups: Any) -> dict[str, list[dict[str, Any]]]:
    """role -> [{rank, pid, host}, plus node_id and node_ip on Ray] of the processes doing each
    role's work (Ray workers report their own; in-process roles run here)."""
    out: dict[str, list[dict[str, Any]]] = {}
    here = {"pid": os.getpid(), "host": socket.gethostname()}
    for role in ("actor", "rollout", "reward", "ref", "critic", "reward_model"):
        group = getattr(groups, role, None)
        if group is None:
            continue
        group = group.group if isinstance(group, RoleView) else group
        identities = getattr(group, "identities", None)
        if callable(identities):
            try:
                out[role] = [{"rank": r, **ident} for r, ident in enumerate(identities())]
                continue
            except Exception as e:  # tracing must never stop a run
                log.warning("trace: no worker identities for %s: %s", role, e)
        out[role] = [{"rank": r, **here} for r in range(group.world_size)]
    return out


# The texts of a record, kept for the sampled conversations only (`conversation_fields`).
TEXT_KEYS = ("prompt", "response")
TURN_TEXT_KEYS = ("text", "arguments", "result")


def sample_records(gen: Batch, groups: Any, n: int, trained: bool = True) -> list[dict[str, Any]]:
    """Per-sample records of a step: ids from prompt to loss, data source, reward (and accuracy),
    length, and which rollout/actor rank handled the sample (the rollout rank as its worker stamped
    it, else, as the actor's, re-derived from the dispatch, a pure function of the batch; no actor
    rank for samples that are not `trained`: validation's); for an agent rollout,
    how it ended, its episode's facts (`episode_facts`: what the `agent/*` numbers are the means
    of) and every turn (kind, tool, tokens, latency, and the texts: the model's, the call's
    arguments, the tool's result); the prompt messages and, without an agent, the response text.
    `conversation_fields` keeps the texts of a sample of them."""
    rollout_rank = dp_ranks(groups.rollout, "generate_sequences", len(gen) // max(n, 1), None)
    actor_rank = dp_ranks(groups.actor, "update_actor", len(gen), gen) if trained else None
    lengths = gen.tensors["response_mask"].sum(-1).long().tolist()
    scores = gen.tensors["scores"].tolist() if "scores" in gen.tensors else [None] * len(gen)
    accs = gen.tensors["acc"].tolist() if "acc" in gen.tensors else None
    rm_scores = gen.tensors["rm_scores"].tolist() if "rm_scores" in gen.tensors else None
    meta = gen.meta
    samples = []
    for j in range(len(gen)):
        rec: dict[str, Any] = {
            "uid": _plain(meta["uid"][j]) if "uid" in meta else None,
            "request_id": _plain(meta["request_id"][j]) if "request_id" in meta else None,
            "reward": scores[j],
            "response_length": lengths[j],
        }
        if "data_source" in meta:
            rec["data_source"] = str(meta["data_source"][j])
        if accs is not None:
            rec["acc"] = accs[j]
        if rm_scores is not None:  # the reward model's raw score (before normalisation and weights)
            rec["rm_score"] = rm_scores[j]
        if rollout_rank is not None:
            rec["rollout_rank"] = int(rollout_rank[j // n])
        for key in ("rollout_rank", "rollout_pid", "rollout_host", "policy_version"):
            if key in meta:
                rec[key] = _plain(meta[key][j])
        if actor_rank is not None:
            rec["actor_rank"] = int(actor_rank[j])
        if "prompt_messages" in meta:
            rec["prompt"] = [dict(m) for m in meta["prompt_messages"][j]]
        if "agent_trace" in meta:  # every turn: assistant turns (tokens, round latency), tool calls, rendered turns
            rec["finish"] = str(meta["agent_finish"][j])
            rec["episode"] = episode_facts(meta, j)
            rec["turns"] = [{k: _plain(v) for k, v in t.items()} for t in meta["agent_trace"][j]]
        elif "response_text" in meta:
            rec["response"] = str(meta["response_text"][j])
        samples.append(rec)
    return samples


def traced_rows(rows: int, k: int) -> list[int]:
    """The `k` rows (of `rows`) whose conversations are recorded: evenly spread, first and last included."""
    if k <= 0 or rows <= 0:
        return []
    if k >= rows:
        return list(range(rows))
    return sorted({round(i * (rows - 1) / max(k - 1, 1)) for i in range(k)})


def clip_text(text: str, max_chars: int, secrets: Sequence[str] = ()) -> str:
    """`text` with `secrets` and the credentials in its URLs redacted, cut to `max_chars` (saying
    how much was cut)."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    text = redact_text(text)
    return text if len(text) <= max_chars else f"{text[:max_chars]}... [{len(text) - max_chars} more chars]"


def _clip(value: Any, max_chars: int, secrets: Sequence[str]) -> Any:
    """A recorded value's strings through `clip_text`; a mapping's values under secret-looking keys
    (`api_key`, `token`, ...) redacted whole (`rlcore.redact.redact_tree`)."""
    if isinstance(value, str):
        return clip_text(value, max_chars, secrets)
    if isinstance(value, Mapping):
        return {k: _clip(v, max_chars, secrets) for k, v in redact_tree(value).items()}
    if isinstance(value, list):
        return [_clip(v, max_chars, secrets) for v in value]
    return value


def secret_values(value: Any, min_chars: int = 4) -> list[str]:
    """The values under secret-looking keys anywhere in `value` (a tool call's arguments), longest
    first: a secret the model passed to a tool is also in the model's own text of the call, which
    is redacted of them too."""
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for k, v in item.items():
                if is_secret_key(str(k)) and isinstance(v, (str, int, float)) and len(str(v)) >= min_chars:
                    found.add(str(v))
                else:
                    stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)
    return sorted(found, key=len, reverse=True)


def conversation_fields(samples: list[dict[str, Any]], k: int, max_chars: int) -> list[dict[str, Any]]:
    """`samples` (from `sample_records`) as trace.jsonl writes them: the texts of `k` evenly spread
    samples kept (redacted, cut to `max_chars`; those samples marked `"conversation": true`), the
    texts of the others dropped."""
    keep = set(traced_rows(len(samples), k))
    out = []
    for j, rec in enumerate(samples):
        rec = dict(rec)
        if j in keep:
            rec["conversation"] = True
            secrets = secret_values([t.get("arguments") for t in rec.get("turns", [])])
            for key in TEXT_KEYS:
                if key in rec:
                    rec[key] = _clip(rec[key], max_chars, secrets)
            if "turns" in rec:
                rec["turns"] = [{key: _clip(v, max_chars, secrets) if key in TURN_TEXT_KEYS else v for key, v in t.items()}
                                for t in rec["turns"]]
        else:
            for key in TEXT_KEYS:
                rec.pop(key, None)
            if "turns" in rec:
                rec["turns"] = [{key: v for key, v in t.items() if key not in TURN_TEXT_KEYS} for t in rec["turns"]]
        out.append(rec)
    return out


def step_record(step: int, off_policy: str, step_trace: dict[str, Any] | None, metrics: dict[str, Any],
                workers: dict[str, Any], conversations: int = 0, max_chars: int = 2000) -> dict[str, Any]:
    """One trace.jsonl line: phase timings with the role that did them, the workers, the samples
    (`conversations` of them with their texts: `conversation_fields`)."""
    step_trace = step_trace or {}
    phases = step_trace.get("phases") or {k[5:-2]: v for k, v in metrics.items()
                                          if k.startswith("time/") and k.endswith("_s")}
    # the texts were redacted before they were cut; every other string (a tool's error, a host
    # name) is redacted here: no secret reaches the file, whichever field carries it
    return redact_tree({
        "step": step,
        "off_policy": off_policy,
        "phases": {name: {"s": secs, "role": PHASE_ROLES.get(name)} for name, secs in phases.items()},
        "workers": workers,
        "samples": conversation_fields(step_trace.get("samples", []), conversations, max_chars),
    })


def validation_record(step: int, samples: list[dict[str, Any]], conversations: int = 0,
                      max_chars: int = 2000) -> dict[str, Any]:
    """One val_trace.jsonl line for a validation run after step `step` (0: before training), marked
    `"validation": true`: every validation sample (`sample_records`, enough to recompute each
    `val/agent/*` number: `rlcore.trainer.validation.recorded_agent_numbers`), `conversations` of
    them with their texts (`conversation_fields`)."""
    return {"step": step, "validation": True, "samples": conversation_fields(samples, conversations, max_chars)}


# ----------------------------------------------------------------------------- reading trace.jsonl back
TRACE_FILE, VAL_TRACE_FILE = "trace.jsonl", "val_trace.jsonl"  # training steps; validations
# rlcore's records nest about 5 levels around a call's arguments, which the agent loop keeps within
# 32 (`rlcore.chat.MAX_ARGUMENT_DEPTH`): a line nested deeper was not written by rlcore.
MAX_RECORD_DEPTH = 64
SHOWN_LINES = 3  # unreadable lines named in a note


class TraceError(RLCoreError, ValueError):
    """A trace.jsonl that cannot show what was asked (no file, no such step or sample, a record of
    the wrong shape): the message names the file, and the line where there is one."""


class TraceLine(NamedTuple):
    number: int  # 1-based, as an editor shows it
    record: dict[str, Any]


@dataclass(frozen=True)
class TraceFile:
    """The readable step records of a run's trace.jsonl and the lines that are not (number, why):
    a line cut short by a killed run, bytes that are not UTF-8, JSON of another shape."""

    path: Path
    lines: list[TraceLine]
    skipped: list[tuple[int, str]]

    def skipped_lines(self) -> str:
        """The unreadable lines (the first few, and how many) in a few words, or "" when none."""
        if not self.skipped:
            return ""
        shown = "; ".join(f"line {n}: {why}" for n, why in self.skipped[:SHOWN_LINES])
        more = f"; and {len(self.skipped) - SHOWN_LINES} more" if len(self.skipped) > SHOWN_LINES else ""
        return f"skipped {len(self.skipped)} unreadable line(s) ({shown}{more})"

    def note(self) -> str:
        """`skipped_lines` naming the file, or "" when none."""
        return f"{self.path}: {self.skipped_lines()}" if self.skipped else ""


def read_trace(run_dir: str | Path, validation: bool = False) -> TraceFile:
    """Every line of `run_dir/trace.jsonl` (`validation`: val_trace.jsonl) that is a step record
    rlcore could have written (`record_problem`); the others are skipped and named
    (`TraceFile.note`), never raised."""
    if not str(run_dir):
        raise TraceError("RUN_DIR is empty: give the run's folder (its trainer.output_dir)")
    path = Path(run_dir) / (VAL_TRACE_FILE if validation else TRACE_FILE)
    if not path.is_file():
        what = "not a file" if path.exists() else "no such file"
        raise TraceError(f"{path}: {what} (trainer.trace writes it in trainer.output_dir{', at each validation' if validation else ''})")
    lines: list[TraceLine] = []
    skipped: list[tuple[int, str]] = []
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                record, why = parse_trace_line(raw)
                if record is None:
                    skipped.append((number, why or "unreadable"))
                else:
                    lines.append(TraceLine(number, record))
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    return TraceFile(path, lines, skipped)


def parse_trace_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the step record, None) of one line of trace.jsonl, or (None, why it is not one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    try:
        value = json.loads(text)
    except RecursionError:
        return None, "nested too deep for the JSON parser"
    except ValueError as e:  # not JSON, or a number of more than 4,300 digits
        return None, f"not JSON ({str(e)[:100]})"
    why = record_problem(value)
    return (None, why) if why is not None else (value, None)


def record_problem(value: Any) -> str | None:
    """Why `value` is not a step record as `step_record` / `validation_record` write it, or None."""
    if not isinstance(value, dict):
        return f"expected a step record (a JSON object), got {_kind(value)}"
    if type(value.get("step")) is not int:
        return f"field 'step': expected an integer, got {_kind(value.get('step'))}"
    if not isinstance(value.get("validation", False), bool):
        return f"field 'validation': expected true or false, got {_kind(value['validation'])}"
    samples = value.get("samples", [])
    if not isinstance(samples, list) or not all(isinstance(x, dict) for x in samples):
        return f"field 'samples': expected a list of sample records, got {_kind(samples)}"
    if nesting_depth(value, MAX_RECORD_DEPTH) > MAX_RECORD_DEPTH:
        return f"nested deeper than {MAX_RECORD_DEPTH} levels"
    return None


def sample_problem(rec: dict[str, Any]) -> str | None:
    """Why a recorded sample cannot be shown as a conversation (`format_trajectory`), or None:
    the fields it reads as lists, messages, turns and numbers, checked for those shapes."""
    prompt = rec.get("prompt", [])
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
        return f"field 'prompt': expected a list of messages, got {_kind(prompt)}"
    turns = rec.get("turns", [])
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return f"field 'turns': expected a list of turns, got {_kind(turns)}"
    for k, t in enumerate(turns):
        latency = t.get("latency_s", 0.0)
        if type(latency) not in (int, float):
            return f"field 'turns[{k}].latency_s': expected a number, got {_kind(latency)}"
    return None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Recorded(NamedTuple):
    """A recorded conversation found in trace.jsonl."""

    step: int
    sample: dict[str, Any]
    recorded: int  # conversations recorded in that record
    line: int  # the record's line in the file
    note: str  # the unreadable lines skipped (`TraceFile.note`), "" when none


def recorded_conversation(run_dir: str | Path, step: int | None = None, sample: int = 0,
                          validation: bool = False) -> Recorded:
    """The `sample`-th recorded conversation of `step` in `run_dir/trace.jsonl` (default: the last
    step that recorded any) or, with `validation`, of the validation at that step in
    val_trace.jsonl. Unreadable lines are skipped and named in the result's `note`; a `TraceError`
    naming the file (and the line) when what was asked is not there or cannot be shown."""
    trace = read_trace(run_dir, validation)
    path, what = trace.path, "validation" if validation else "step"
    by_step: dict[int, TraceLine] = {}
    for read in trace.lines:
        by_step[read.record["step"]] = read  # a step written twice (a resumed run): its last record
    conversations = {k: [s for s in read.record.get("samples", []) if s.get("conversation")] for k, read in by_step.items()}

    def refuse(message: str) -> TraceError:
        return TraceError("; ".join(m for m in (f"{path}: {message}", trace.skipped_lines()) if m))

    steps = [k for k, found in conversations.items() if found]
    if not steps:
        why = "trainer.trace_samples was 0, or the run predates it" if by_step else "none is readable"
        raise refuse(f"no {what} recorded a conversation ({why})")
    step = steps[-1] if step is None else step
    if step not in by_step:
        raise refuse(f"no {what} {step} ({what}s recorded: {_listed(sorted(by_step))})")
    found, line = conversations[step], by_step[step].number
    if not 0 <= sample < len(found):
        if not found:
            raise refuse(f"line {line}: {what} {step} recorded no conversation (those that did: {_listed(sorted(steps))})")
        raise refuse(f"line {line}: {what} {step} recorded {len(found)} conversation(s); --sample is 0..{len(found) - 1}")
    problem = sample_problem(found[sample])
    if problem is not None:
        raise refuse(f"line {line}: {what} {step}, --sample {sample}: {problem}")
    return Recorded(step, found[sample], len(found), line, trace.note())


def _listed(steps: list[int]) -> str:
    """Steps for a message: all of a few, else the first, the last and how many."""
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} in all)"


def format_trajectory(step: int, rec: dict[str, Any], index: int = 0, recorded: int = 1, validation: bool = False) -> str:
    """One recorded sample as a readable conversation: the prompt, each assistant turn's text, each
    tool call with its arguments, outcome and result, and how the episode ended; the header says
    whether the final answer holds the last tool result (`episode_facts`), where a tool answered."""
    where = f"validation at step {step}" if validation else f"step {step}"
    head = [f"{where}, conversation {index + 1} of {recorded}", f"request {rec.get('request_id')}",
            f"reward {rec.get('reward')}"]
    if "finish" in rec:
        head.append(f"finished: {rec['finish']}")
    episode = rec.get("episode")
    copied = episode.get("answer_has_tool_result") if isinstance(episode, dict) else None
    if copied is not None:
        head.append(f"answer holds the tool result: {'yes' if copied else 'no'}")
    lines = [" | ".join(head), ""]
    prompt = rec.get("prompt", [])
    for m in [{"role": "prompt", "content": prompt}] if isinstance(prompt, str) else prompt:
        lines.append(f"[{m.get('role')}] {m.get('content')}")
    if "response" in rec:
        lines.append(f"[assistant] {rec['response']}")
    for t in rec.get("turns", []):
        kind = t.get("kind")
        if kind == "assistant":
            lines.append(f"[assistant, turn {t.get('turn')}, {t.get('tokens')} tokens] {t.get('text', '')}")
        elif kind == "tool":
            outcome = "ok" if t.get("ok") else f"error: {t.get('error')}"
            args = json.dumps(t.get("arguments"), ensure_ascii=False)
            lines.append(f"  -> {t.get('tool')}({args}) {outcome}, {t.get('latency_s', 0.0):.3f} s")
            lines.append(f"[tool {t.get('tool')}] {t.get('result', '')}")
        elif kind == "interaction" and not t.get("ok", True):
            lines.append(f"  -> interaction error: {t.get('error')}")
        elif kind == "rendered" and t.get("ok") is False:
            lines.append(f"  -> the template could not render the {t.get('role', 'next')} message: {t.get('error')}")
    return "\n".join(lines)


def _plain(v: Any) -> Any:
    """numpy scalars -> JSON-friendly Python values."""
    return v.item() if isinstance(v, np.generic) else v


def dp_ranks(group: Any, method: str, rows: int, batch: Batch | None) -> np.ndarray | None:
    """Which rank of `group` receives each of `rows` input rows for `method`, re-derived from its
    dispatch (contiguous parts, or token-balanced parts of `batch`); None when not data-parallel."""
    try:
        spec = group.group.methods[f"{group._role}.{method}"] if isinstance(group, RoleView) else group.methods[method]
        ws = group.group.world_size if isinstance(group, RoleView) else group.world_size
    except (AttributeError, KeyError):
        return None
    per_shard = spec.ranks_per_shard  # a sequence-parallel group's ranks share their rows: name its first
    ws //= per_shard
    padded = -(-rows // ws) * ws
    if spec.dispatch is Dispatch.DP_COMPUTE or (spec.dispatch is Dispatch.DP_BALANCED and ws == 1):
        return np.arange(padded)[:rows] // (padded // ws) * per_shard
    if spec.dispatch is Dispatch.DP_BALANCED and batch is not None and "attention_mask" in batch.tensors:
        lengths = batch.tensors["attention_mask"].sum(-1).cpu().numpy().astype(np.int64)
        lengths = np.concatenate([lengths, lengths[np.arange(padded - rows) % rows]])  # as pad_to_multiple
        ranks = np.empty(padded, dtype=np.int64)
        for r, part in enumerate(balanced_partitions(lengths, ws)):
            ranks[part] = r
        return ranks[:rows] * per_shard
    return None
