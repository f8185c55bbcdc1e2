"""Agent rollouts: multi-turn generation with tools or an environment, on top of either engine.

Per sample, the loop generates an assistant turn, and then:
- the turn calls tools (hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number per turn): they run in the tool pool (`rlcore.rewards.tools`, sandboxed worker
  processes), and their results are appended as `tool` messages rendered by the chat template,
  followed by the next assistant header; generation continues;
- otherwise, with an interaction (an environment that answers each assistant turn), its reply is
  appended as a `user` message, unless it ended the episode (it may give a reward);
- otherwise the turn is the final answer.
An episode also ends after `max_turns` assistant turns, when its response reaches
`max_total_tokens` tokens (model turns, tool outputs and template tokens together), when a turn
runs to `max_new_tokens` without an end token, or when a turn ends with an end token the template
does not close assistant turns with (Qwen's `<|endoftext|>`: the model ended the conversation).

Token exactness: a sample's response is the engine's own ids for its turns and the template's
rendering of what came between them (tokenized once, never the model's tokens decoded and
re-encoded), so the ids the actor scores are exactly the ids that were sampled plus the rendered
tool turns. `response_mask` is 1 on model tokens and 0 on tool outputs and template tokens, which
are attended to (`attention_mask`) but get no loss, KL or advantage; `rollout_log_probs` are the
engine's on model tokens and 0 elsewhere.

Concurrency: samples never wait for each other. The loop keeps every sample in one of three
states: ready for its next turn, waiting for its tool calls, or done. Each round generates one
turn for all ready samples in one engine call (`generate_turns`: HF decoding, or vLLM requests
continued from token ids, batched across samples), submits the tool calls those turns made, and
collects whichever tool results have arrived; it waits only when no sample is ready, and then only
until results stop arriving back to back (`_QUIET_S`), so a slow tool call holds back its own
sample and no other. Sampling is keyed per sample (HF; see `rlcore.rollout.sampling`), so a
sample's tokens do not depend on which round its turns ran in.

Template rendering: the tokens between two assistant turns are the template's text after the
assistant turn's end token (ChatML's newline) followed by the rendering of the new messages with
the generation prompt, taken as the difference of two renderings of a fixed stand-in conversation
(`rlcore.chat.ChatTurns`, which SFT renders its conversations with too), so a template that
rewrites earlier turns from their content (Qwen3's thinking) cannot shift them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from rlcore.chat import MAX_ARGUMENT_DEPTH, ChatTurns, ToolCall, nesting_depth, parse_tool_calls
from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.output import rollout_output

log = logging.getLogger(__name__)

# After the first tool result arrives while no sample is ready, keep collecting while results
# keep coming within this gap: a batch of fast calls (the common case) becomes one generation
# round, and a slow call is left behind after one gap.
_QUIET_S = 0.02
_WAIT_S = 1.0  # longest single wait on the tool pool (it polices timeouts in between)

class TurnEngine(Protocol):
    """What the loop needs from a rollout engine (both backends implement it)."""

    def generate_turns(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_tokens: Sequence[int], keys: Sequence[int]
    ) -> list[tuple[list[int], list[float]]]: ...


class ToolResult(Protocol):
    """A finished tool call (`rlcore.rewards.tools.ToolOutcome`)."""

    @property
    def call_id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def text(self) -> str: ...  # what the model reads: the result, or the error
    @property
    def ok(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def timed_out(self) -> bool: ...
    @property
    def latency_s(self) -> float: ...


class ToolRunner(Protocol):
    """Asynchronous tool calls (`rlcore.rewards.tools.ToolPool`)."""

    @property
    def pending(self) -> int: ...

    def submit(self, call_id: int, name: str, arguments: Any) -> None: ...

    def poll(self, timeout: float = 0.0) -> Sequence[ToolResult]: ...


@dataclass(frozen=True)
class InteractionReply:
    """An environment's answer to an assistant turn: `content` becomes the next user message,
    unless `done` ends the episode; `reward` (optional) is the episode's, given to the reward
    function as `extra_info["interaction_reward"]` (the last one given counts)."""

    content: str = ""
    done: bool = False
    reward: float | None = None

    @classmethod
    def of(cls, value: Any) -> InteractionReply:
        """An interaction may answer with an `InteractionReply`, a dict of its fields, or a string."""
        if isinstance(value, InteractionReply):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            unknown = set(value) - {"content", "done", "reward"}
            if unknown:
                raise TypeError(f"interaction reply has unknown keys {sorted(unknown)} (content, done, reward)")
            reward = value.get("reward")
            return cls(str(value.get("content", "")), bool(value.get("done", False)),
                       None if reward is None else float(reward))
        raise TypeError(f"interaction reply must be an InteractionReply, a dict or a str, got {type(value).__name__}")


# An interaction is made per episode by a factory (a class, usually) called with the sample's
# data_source, ground_truth and extra_info, and answers `respond(messages) -> reply`.
InteractionFactory = Callable[..., Any]


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 4  # assistant turns per sample
    max_total_tokens: int = 256  # response tokens: every turn, tool output and template token


def model_text(text: Any) -> tuple[str, bool]:
    """(`text` as a string a tokenizer can encode, whether it had to change): lone surrogates (from
    JSON escapes such as "\\udc80", or bytes decoded with `surrogateescape`) become U+FFFD."""
    if type(text) is not str:
        return repr(text) if not isinstance(text, str) else str.__str__(text), True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), True
    return text, False


@dataclass
class _Episode:
    """One sample's trajectory while it is being generated."""

    row: int
    key: int
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    interaction: Any = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    interaction_errors: int = 0
    reward: float | None = None
    finish: str = ""
    end_id: int = -1
    waiting: dict[int, int] = field(default_factory=dict)  # call id -> position in this turn's calls
    results: list[dict[str, Any] | None] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)  # this turn's calls, in the order the model wrote them
    trace: list[dict[str, Any]] = field(default_factory=list)

    def append(self, ids: Sequence[int], model: bool, logps: Sequence[float] | None = None) -> None:
        self.ids.extend(int(t) for t in ids)
        self.mask.extend([1 if model else 0] * len(ids))
        self.logps.extend(logps if logps is not None else [0.0] * len(ids))


def sample_key(uid: Any, i: int) -> int:
    """A stable 63-bit key per sample (prompt uid, sample index): the same on any rank or batch."""
    digest = hashlib.blake2b(f"{uid}/{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class AgentLoop:
    """Multi-turn rollouts on `engine` (see the module docstring). `generate` returns the rollout
    output batch every backend returns, plus per-sample agent metadata (`agent_*` meta)."""

    def __init__(self, engine: TurnEngine, tokenizer: Any, end_token_ids: Sequence[int], settings: AgentSettings,
                 tools: ToolRunner | None = None, interaction: InteractionFactory | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.end_ids = {int(t) for t in end_token_ids}
        self.settings = settings
        self.tools = tools
        self.interaction = interaction
        self.turns = ChatTurns(tokenizer)
        if tools is not None and not self.turns.renders_tools:
            raise ValueError("the chat template does not render 'tool' messages, so tool results cannot be shown "
                             "to the model (rollout.agent.tools needs a template with a tool role)")
        self._call_ids = itertools.count()
        self.pad_id = int(getattr(engine, "pad_token_id", 0))

    # ------------------------------------------------------------------ the loop
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        episodes = self._start(batch, params.n)
        ready = list(episodes)
        by_call: dict[int, _Episode] = {}
        while ready or by_call:
            if ready:
                ready = self._generate_round(ready, params, by_call)
            ready += self._collect(by_call, wait=not ready)
        return self._output(batch, episodes, params)

    def _start(self, batch: Batch, n: int) -> list[_Episode]:
        prompt_ids, prompt_mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]
        meta = batch.meta
        uids = meta["uid"] if "uid" in meta else np.arange(len(batch))
        episodes = []
        for i in range(len(batch)):
            ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
            messages = [dict(m) for m in meta["prompt_messages"][i]] if "prompt_messages" in meta else []
            for j in range(n):
                ep = _Episode(row=i * n + j, key=sample_key(uids[i], j), prompt_ids=ids, messages=[dict(m) for m in messages])
                if self.interaction is not None:
                    ep.interaction = self._make_interaction(ep, meta, i)
                episodes.append(ep)
        return episodes

    def _make_interaction(self, ep: _Episode, meta: dict[str, np.ndarray], i: int) -> Any:
        kwargs = {k: meta[k][i] for k in ("data_source", "ground_truth", "extra_info") if k in meta}
        try:
            return self.interaction(**kwargs)  # type: ignore[misc]
        except Exception as e:  # a user object: counted, the episode runs without it
            ep.interaction_errors += 1
            ep.trace.append({"turn": 0, "kind": "interaction", "ok": False, "error": f"{type(e).__name__}: {e}"})
            log.warning("agent: the interaction could not be created for sample %d: %s: %s", ep.row, type(e).__name__, e)
            return None

    def _generate_round(self, ready: list[_Episode], params: SamplingParams, by_call: dict[int, _Episode]) -> list[_Episode]:
        """One turn for every ready sample; returns those ready for another turn at once (an
        interaction answered, or every tool call was unreadable)."""
        budget = self.settings.max_total_tokens
        limits = [min(params.max_new_tokens, budget - len(ep.ids)) for ep in ready]
        start = time.perf_counter()
        turns = self.engine.generate_turns([ep.prompt_ids + ep.ids for ep in ready], params, limits, [ep.key for ep in ready])
        seconds = time.perf_counter() - start
        for ep, (ids, logps) in zip(ready, turns):
            ep.turns += 1
            ep.append(ids, True, logps)
            ended = bool(ids) and ids[-1] in self.end_ids
            body = ids[:-1] if ended else ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            ep.messages.append(message)
            ep.trace.append({"turn": ep.turns, "kind": "assistant", "text": text, "tokens": len(ids), "latency_s": seconds,
                             "batch": len(ready)})
            if not ended:
                ep.finish = "max_total_tokens" if len(ep.ids) >= budget else "max_new_tokens"
                continue
            ep.end_id = ids[-1]
            if self.turns.closing(ep.end_id) is None:
                ep.finish = "end_token"
                continue
            calls = parse_tool_calls(text) if self.tools is not None else []
            if calls:
                message["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls if c.error is None]
                if ep.turns >= self.settings.max_turns:
                    ep.finish = "max_turns"
                    continue
                self._call_tools(ep, calls, by_call)
            elif ep.interaction is not None:
                self._interact(ep)
            else:
                ep.finish = "answer"
        again = []
        for ep in ready:
            if not ep.finish and not ep.waiting:
                if ep.messages[-1]["role"] == "user":  # an interaction's reply
                    self._continue(ep, [ep.messages[-1]])
                if not ep.finish:
                    again.append(ep)
        return again

    def _call_tools(self, ep: _Episode, calls: list[ToolCall], by_call: dict[int, _Episode]) -> None:
        assert self.tools is not None
        ep.results = [None] * len(calls)
        ep.calls = calls
        ep.tool_calls += len(calls)
        for k, call in enumerate(calls):
            if call.error is not None:
                ep.results[k] = self._result(ep, call.name or "?", f"Error: {call.error}", False, call.error, False, 0.0, k)
                continue
            call_id = next(self._call_ids)
            ep.waiting[call_id] = k
            by_call[call_id] = ep
            self.tools.submit(call_id, call.name, call.arguments)
        if not ep.waiting:  # every call was unreadable: answer at once
            self._tool_turn(ep)

    def _result(self, ep: _Episode, name: str, text: str, ok: bool, error: str | None, timed_out: bool,
                latency_s: float, call: int | None = None) -> dict[str, Any]:
        """The tool message the model reads. Whatever a tool or the model's call held, it is text
        the tokenizer encodes: a result that is not (lone surrogates, not a string) is a counted
        error; a name or error text that is not is repaired (U+FFFD)."""
        name = model_text(name)[0]
        text, changed = model_text(text)
        if changed and ok:
            ok, error = False, "InvalidToolResult: the tool's result is not valid Unicode text"
            text = f"Error: {error}"
        error = None if error is None else model_text(error)[0]
        if not ok:
            ep.tool_errors += 1
            ep.tool_timeouts += int(timed_out)
        arguments = ep.calls[call].arguments if call is not None else None  # `call`: its place in the turn's calls
        ep.trace.append({"turn": ep.turns, "kind": "tool", "call": call, "tool": name, "arguments": arguments,
                         "ok": ok, "error": error, "latency_s": latency_s, "result": text})
        return {"role": "tool", "name": name, "content": text}

    def _collect(self, by_call: dict[int, _Episode], wait: bool) -> list[_Episode]:
        """Samples whose tool calls have all answered, now ready for their next turn. With `wait`
        (nothing else to do), block until some arrive and then while they keep arriving."""
        if self.tools is None or not by_call:
            return []
        outcomes = list(self.tools.poll(_WAIT_S if wait else 0.0))
        if wait:
            while not outcomes:  # nothing else to do: wait on (the pool polices timeouts meanwhile)
                outcomes = list(self.tools.poll(_WAIT_S))
            while len(outcomes) < len(by_call):
                more = self.tools.poll(_QUIET_S)
                if not more:
                    break
                outcomes += more
        ready = []
        for o in outcomes:
            ep = by_call.pop(o.call_id)
            k = ep.waiting.pop(o.call_id)
            ep.results[k] = self._result(ep, o.name, o.text, o.ok, o.error, o.timed_out, o.latency_s, k)
            if not ep.waiting:
                self._tool_turn(ep)
                if not ep.finish:
                    ready.append(ep)
        return ready

    def _tool_turn(self, ep: _Episode) -> None:
        results = [r for r in ep.results if r is not None]
        ep.messages.extend(results)
        ep.results = []
        self._continue(ep, results)

    def _continue(self, ep: _Episode, new_messages: list[dict[str, Any]]) -> None:
        """Append the rendered messages and the next assistant header, if a turn still fits."""
        try:
            ids = self.turns.between(ep.end_id, new_messages)
        except Exception as e:  # noqa: BLE001 - the template refused this content: end this episode, not the run
            ep.finish = "render_error"
            ep.trace.append({"turn": ep.turns, "kind": "rendered", "ok": False, "error": model_text(f"{type(e).__name__}: {e}")[0]})
            log.warning("agent: the chat template could not render sample %d's %s message: %s: %s", ep.row,
                        new_messages[-1]["role"], type(e).__name__, e)
            return
        if len(ep.ids) + len(ids) >= self.settings.max_total_tokens:
            ep.finish = "max_total_tokens"
            return
        ep.append(ids, False)
        ep.trace.append({"turn": ep.turns, "kind": "rendered", "role": new_messages[-1]["role"], "tokens": len(ids)})

    def _interact(self, ep: _Episode) -> None:
        try:
            reply = InteractionReply.of(ep.interaction.respond([dict(m) for m in ep.messages]))
        except Exception as e:  # user code: counted, the episode ends here
            ep.interaction_errors += 1
            ep.finish = "interaction_error"
            ep.trace.append({"turn": ep.turns, "kind": "interaction", "ok": False, "error": f"{type(e).__name__}: {e}"})
            return
        if reply.reward is not None:
            ep.reward = reply.reward
        if reply.done or ep.turns >= self.settings.max_turns:
            ep.finish = "interaction" if reply.done else "max_turns"
            return
        ep.messages.append({"role": "user", "content": model_text(reply.content)[0]})

    # ------------------------------------------------------------------ the output batch
    def _output(self, batch: Batch, episodes: list[_Episode], params: SamplingParams) -> Batch:
        width = max(1, max(len(ep.ids) for ep in episodes))
        rows = len(episodes)
        responses = torch.full((rows, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.float32)
        attended = torch.zeros((rows, width), dtype=torch.float32)
        log_probs = torch.zeros((rows, width), dtype=torch.float32)
        for ep in episodes:
            k = len(ep.ids)
            if k:
                responses[ep.row, :k] = torch.tensor(ep.ids, dtype=torch.long)
                response_mask[ep.row, :k] = torch.tensor(ep.mask, dtype=torch.float32)
                attended[ep.row, :k] = 1.0
                log_probs[ep.row, :k] = torch.tensor(ep.logps, dtype=torch.float32)
        out = rollout_output(batch, responses, response_mask, log_probs, params, attended)
        episodes = sorted(episodes, key=lambda ep: ep.row)
        meta: dict[str, Any] = dict(out.meta)
        meta.update({
            "agent_messages": [ep.messages for ep in episodes],
            "agent_turns": np.array([ep.turns for ep in episodes], dtype=np.int64),
            "agent_tool_calls": np.array([ep.tool_calls for ep in episodes], dtype=np.int64),
            "agent_tool_errors": np.array([ep.tool_errors for ep in episodes], dtype=np.int64),
            "agent_tool_timeouts": np.array([ep.tool_timeouts for ep in episodes], dtype=np.int64),
            "agent_interaction_errors": np.array([ep.interaction_errors for ep in episodes], dtype=np.int64),
            "agent_reward": np.array([math.nan if ep.reward is None else ep.reward for ep in episodes], dtype=np.float64),
            "agent_finish": np.array([ep.finish for ep in episodes], dtype=object),
            "agent_trace": [ep.trace for ep in episodes],
        })
        return Batch(tensors=out.tensors, meta=meta, info=out.info)


__all__ = ["MAX_ARGUMENT_DEPTH", "AgentLoop", "AgentSettings", "ChatTurns", "InteractionReply", "ToolCall", "ToolResult",
           "ToolRunner", "TurnEngine", "model_text", "nesting_depth", "parse_tool_calls", "sample_key"]
