"""What the model sees of a conversation: the one rendering of chat messages into token ids that
RL prompts, agent rollouts and SFT share, so a model is trained on exactly the ids it is sampled
and scored on.

- A prompt (chat messages or a plain string) is rendered by `render_prompt` / `prompt_ids`: the
  chat template with its generation prompt and, in an agent run, the tools' schemas (`tools=`;
  Qwen's template renders them into the system turn). The RL dataset, evaluation and SFT all call
  it.
- Between two assistant turns of an agent rollout come the template's tokens for what was said in
  between (tool results, an environment's reply) and the next assistant header: `ChatTurns.between`.
- An SFT conversation (`conversation_ids`) is the RL trajectory those two make: the messages
  before the first assistant turn as the RL prompt, each assistant turn as the text the model
  writes (a turn's OpenAI-style `tool_calls` as the template renders them, or in the hermes
  format the agent loop parses) followed by the end token that closes assistant turns, and the
  messages between turns as `ChatTurns.between` renders them; the trained mask is 1 exactly where
  an agent rollout's `response_mask` is.
- The calls a model writes, in the hermes format, are read back by `parse_tool_calls` (the agent
  loop's parser; `hermes_tool_call` writes them), so SFT checks the calls it trains exactly as the
  loop would read them.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MARK = "RLCORE_AGENT_TURN"  # stand-in content whose rendering locates the template's own tokens


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 3, 4, 4, 60, 60


def short_repr(value: Any, limit: int = 80) -> str:
    """`value` for an error message: at most `limit` characters and 3 levels deep (a row's value
    may nest 50,000 levels or hold a megabyte: `repr` would recurse or print it all)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def renders_tool_schemas(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes tool schemas into a prompt (Qwen2.5: the system
    turn's `<tools>` block): then a conversation that calls tools needs them, or the model learns
    calls against a prompt that lists no tools."""
    if not has_chat_template(tokenizer):
        return False
    schema = {"type": "function", "function": {"name": MARK, "description": "", "parameters": {"type": "object"}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=[schema], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot take tools renders none
        return False
    return MARK in str(text)


def render_prompt(prompt: str | list[dict[str, str]], tokenizer: Any, apply_chat_template: bool = True,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """Render `prompt` as text ready for generation.

    Messages go through the tokenizer's chat template with the generation prompt appended when
    the tokenizer has one and `apply_chat_template` is on; otherwise the message contents are
    joined with newlines. A plain string is returned as is. `tools` (OpenAI-style schemas of an
    agent run's tools) go to the template, which renders them its way (Qwen: in the system turn).
    """
    if isinstance(prompt, str):
        return prompt
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    if apply_chat_template and has_chat_template(tokenizer):
        if tools:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def as_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """A dataset prompt as chat messages (a plain string is one user message): what a reward model
    with its own chat template renders a conversation from."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def render_conversation(messages: list[dict[str, str]], response: str, tokenizer: Any) -> str:
    """The whole conversation (prompt messages, then `response` as the assistant's turn) in the
    tokenizer's chat template: what a reward model scores, the same in its training and in RL.
    ValueError when the tokenizer has no chat template."""
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template to render a conversation with")
    turns = [*messages, {"role": "assistant", "content": response}]
    text: str = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    return text


def encode_prompt(text: str, tokenizer: Any, templated: bool) -> list[int]:
    """Token ids of a rendered prompt. A chat template already wrote the special tokens it wants
    (BOS included), so the tokenizer must not add them a second time."""
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def prompt_ids(prompt: str | list[dict[str, str]], tokenizer: Any, apply_chat_template: bool = True,
               tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) for one prompt (`tools`: see `render_prompt`)."""
    text = render_prompt(prompt, tokenizer, apply_chat_template, tools)
    templated = not isinstance(prompt, str) and apply_chat_template and has_chat_template(tokenizer)
    return text, encode_prompt(text, tokenizer, templated)


class ChatTurns:
    """The tokens a chat template puts around assistant turns, taken as the difference of two
    renderings of a fixed stand-in conversation, so a template that rewrites earlier turns from
    their content (Qwen3's thinking) cannot shift them.

    `between`: the tokens after an assistant turn (the template's closing text after its end
    token, ChatML's newline), the new messages (tool results, a user reply) and the next assistant
    header. `assistant_text`: what the model writes for an assistant message, tool calls included."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("agent rollouts need a chat template (the tokenizer has none)")
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
        try:
            base = self._render(self._base, False)
        except Exception as e:  # a template that cannot render a user/assistant exchange
            raise ValueError(f"the chat template cannot render a conversation ({type(e).__name__}: {e})") from e
        if MARK not in base:
            raise ValueError("the chat template does not render assistant turns' content")
        self.after_content = base[base.rindex(MARK) + len(MARK):]
        self._base_text = base
        try:  # templates without a tool role render nothing for it, or raise
            probe = self._render([*self._base, {"role": "tool", "content": MARK}], True)
        except Exception:  # noqa: BLE001
            probe = ""
        self.renders_tools = probe.startswith(base) and MARK in probe[len(base):]
        self._header = self._render(self._base[:1], True)  # the prompt, then the assistant's generation prompt
        try:  # templates that know OpenAI-style tool_calls render them (Qwen: hermes <tool_call> blocks)
            probe = self._render([self._base[0], _assistant_with_calls("", [(MARK, {})])], False)
        except Exception:  # noqa: BLE001
            probe = ""
        self.renders_tool_calls = MARK in probe

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text: str = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return text

    def ids(self, text: str) -> list[int]:
        """Ids of template text (no special tokens added: the template wrote those it wants)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def closing(self, end_id: int) -> str | None:
        """The template's text after an assistant turn's content once the model stopped at `end_id`
        (ChatML: "\\n" after <|im_end|>), or None if the template does not end turns with it."""
        end_text = self.tokenizer.decode([end_id], skip_special_tokens=False)
        if end_text and self.after_content.startswith(end_text):
            return self.after_content[len(end_text):]
        return None

    def turn_end(self, end_ids: Sequence[int]) -> int | None:
        """The one of `end_ids` (the model's end tokens) that closes an assistant turn in this
        template, or None when none does."""
        return next((int(t) for t in end_ids if self.closing(int(t)) is not None), None)

    def between(self, end_id: int, messages: list[dict[str, Any]]) -> list[int]:
        """Ids after an assistant turn that ended with `end_id`: the template's closing text, the
        new `messages` (tool results, a user reply) and the next assistant header."""
        closing = self.closing(end_id)
        if closing is None:
            raise ValueError(f"the chat template does not end assistant turns with token {end_id}")
        full = self._render([*self._base, *messages], True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template does not render new messages as a continuation of the turns before them")
        return self.ids(closing + full[len(self._base_text):])

    def assistant_text(self, message: dict[str, Any]) -> str:
        """The text the model writes for an assistant `message` (without its end token): its
        content; with OpenAI-style `tool_calls`, the calls as the template renders them between its
        generation prompt and the turn's end (Qwen: `<tool_call>\\n{"name": ..., "arguments":
        ...}\\n</tool_call>`), or in the hermes format after the content when the template does not
        render tool calls. ValueError on a malformed call."""
        content = message.get("content")
        content = "" if content is None else str(content)
        calls = tool_calls_of(message)
        if not calls:
            return content
        if not self.renders_tool_calls:
            return "\n".join(([content] if content else []) + [hermes_tool_call(n, a) for n, a in calls])
        text = self._render([self._base[0], _assistant_with_calls(content, calls)], False)
        if not text.startswith(self._header) or not text.endswith(self.after_content):
            raise ValueError("the chat template does not render an assistant turn with tool_calls as its generation "
                             "prompt, the turn, and the end it gives assistant turns")
        return text[len(self._header):len(text) - len(self.after_content)]


# ----------------------------------------------------------------------------- reading the calls a model writes
# The hermes format the agent loop parses (`parse_tool_calls`) and `hermes_tool_call` writes; SFT
# checks the calls it trains with the same functions, so it never trains a call the loop refuses.
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any
    error: str | None = None  # why the call could not be read (then it is not run)


# Tool-call arguments nested deeper than this are refused as unreadable: no tool needs more, and
# everything downstream (pickling to the tool worker, the trace, the reward's extra_info) stays
# far from Python's recursion limit.
MAX_ARGUMENT_DEPTH = 32


def nesting_depth(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), counted without recursion; stops
    counting once past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_json(text: str) -> tuple[Any, str | None]:
    """`text` parsed as JSON, or the reason it cannot be read (any input: never raises)."""
    try:
        value = json.loads(text)
    except RecursionError:
        return None, f"nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    except ValueError as e:
        return None, f"not JSON ({str(e)[:200]})"
    if nesting_depth(value) > MAX_ARGUMENT_DEPTH:
        return None, f"nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    return value, None


def tool_call_bodies(text: str) -> list[str]:
    """The text between each <tool_call> and the first </tool_call> after it, in order (as the
    non-greedy pattern `<tool_call>(.*?)</tool_call>` finds them, in linear time: the pattern
    rescans to the end of the text for every unclosed tag)."""
    bodies, pos = [], 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end < 0:
            break
        bodies.append(text[start + len(OPEN_TAG):end])
        pos = end + len(CLOSE_TAG)
    return bodies


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The hermes-format tool calls in an assistant turn's text, in order; an unreadable one (not
    JSON, nested too deep, not a call) is a `ToolCall` with `error` set (the model is told why, and
    it counts as a tool error). Never raises, whatever the text."""
    calls = []
    for body in tool_call_bodies(text):
        call, why = read_json(body)
        if why is not None:
            calls.append(ToolCall("", None, f"InvalidToolCall: {why}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("", None, 'InvalidToolCall: expected {"name": ..., "arguments": {...}}'))
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args, why = read_json(args)
            if why is not None:
                calls.append(ToolCall(call["name"], None, f"InvalidToolCall: arguments are {why}"))
                continue
        if not isinstance(args, dict):
            calls.append(ToolCall(call["name"], None, "InvalidToolCall: arguments must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], args))
    opened, closed = text.count(OPEN_TAG), text.count(CLOSE_TAG)
    if opened > closed:
        calls.append(ToolCall("", None, "InvalidToolCall: <tool_call> without </tool_call>"))
    return calls



def hermes_tool_call(name: str, arguments: Any) -> str:
    """A tool call in the hermes format the agent loop parses (`rlcore.rollout.agent.parse_tool_calls`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def _assistant_with_calls(content: str, calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}


def tool_calls_of(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call in an assistant message's `tool_calls`: OpenAI's
    `{"type": "function", "function": {"name", "arguments"}}` (arguments a JSON string or an object)
    or the agent loop's own `{"name", "arguments"}`. ValueError naming what is wrong, also for
    arguments the agent loop would refuse (`read_json`: not JSON, nested too deep)."""
    raw = message.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"tool_calls: expected a list, got {type(raw).__name__}")
    calls = []
    for k, call in enumerate(raw):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool_calls[{k}]: expected {{'type': 'function', 'function': {{'name': str, "
                             f"'arguments': ...}}}}, got {short_repr(call, 120)}")
        if not isinstance(call.get("id", ""), str):
            raise ValueError(f"tool_calls[{k}].id: expected a string, got {short_repr(call['id'])}")
        args = fn.get("arguments")
        args = {} if args is None else args
        if isinstance(args, str):
            args, why = read_json(args) if args.strip() else ({}, None)
            if why is not None:
                raise ValueError(f"tool_calls[{k}].function.arguments: {why}")
        if not isinstance(args, dict):
            raise ValueError(f"tool_calls[{k}].function.arguments: expected a JSON object, got {type(args).__name__}")
        if nesting_depth(args) > MAX_ARGUMENT_DEPTH:
            raise ValueError(f"tool_calls[{k}].function.arguments: nested deeper than {MAX_ARGUMENT_DEPTH} levels "
                             "(the agent loop refuses such a call)")
        calls.append((fn["name"], args))
    return calls


def conversation_ids(messages: list[dict[str, Any]], turns: ChatTurns, end_ids: Sequence[int],
                     tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(ids, trained) of a conversation rendered as an agent rollout holds it (module docstring):
    `trained` is 1 on the assistant turns' tokens (their text and end token) and 0 on the prompt,
    tool results, other messages and template tokens. Messages after the last assistant turn are
    not used. `end_ids`: the model's end tokens (a turn already ending with one keeps it; a turn
    ending with one the template does not close turns with must be the last). ValueError when the
    conversation cannot be rendered so (no assistant turn, nothing before the first one, a
    template whose assistant turns do not end with one of `end_ids`). `turns`: the tokenizer's
    `ChatTurns` (made once per tokenizer: it renders the template a few times)."""
    roles = [str(m.get("role")) for m in messages]
    if "assistant" not in roles:
        raise ValueError("no assistant turn to learn from")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("the conversation opens with an assistant turn: a rollout's prompt comes before it")
    end = turns.turn_end(end_ids)
    if end is None:
        raise ValueError(f"the chat template closes assistant turns with {turns.after_content[:40]!r}, which does not "
                         f"start with one of the model's end tokens {list(end_ids)}: a rollout could not continue after "
                         "an assistant turn")
    ids = prompt_ids(messages[:first], turns.tokenizer, True, tools)[1]
    trained = [0] * len(ids)
    starts = [i for i, r in enumerate(roles) if r == "assistant"]
    for k, i in enumerate(starts):
        turn = turns.ids(turns.assistant_text(messages[i]))
        last = k + 1 == len(starts)
        if turn and turn[-1] in end_ids:
            if turn[-1] != end and not last:
                raise ValueError(f"assistant turn {k} ends with end token {turn[-1]}, which ends a rollout; turns follow it")
        else:
            turn.append(end)
        ids += turn
        trained += [1] * len(turn)
        if not last:
            between = turns.between(turn[-1], _rendered_messages(messages[i:starts[k + 1]]))
            ids += between
            trained += [0] * len(between)
    return ids, trained


def _rendered_messages(span: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after an assistant turn (`span[0]`) as the agent loop renders them: a tool
    result as `{"role": "tool", "name", "content"}` (the name from the message, else from the call
    it answers: by `tool_call_id`, else by position), anything else as role and content."""
    calls = span[0].get("tool_calls") or []
    by_id = {c.get("id"): (c.get("function") or c).get("name") for c in calls if isinstance(c, dict) and c.get("id")}
    names = [(c.get("function") or c).get("name") for c in calls if isinstance(c, dict)]
    out: list[dict[str, Any]] = []
    for m in span[1:]:
        content = "" if m.get("content") is None else str(m["content"])
        if m.get("role") != "tool":
            out.append({"role": str(m.get("role")), "content": content})
            continue
        k = sum(1 for o in out if o["role"] == "tool")
        name = m.get("name") or by_id.get(m.get("tool_call_id")) or (names[k] if k < len(names) else None)
        out.append({"role": "tool", "content": content} if name is None else {"role": "tool", "name": str(name), "content": content})
    return out


__all__ = ["CLOSE_TAG", "MARK", "MAX_ARGUMENT_DEPTH", "OPEN_TAG", "ChatTurns", "ToolCall", "as_messages", "conversation_ids",
           "encode_prompt", "has_chat_template", "hermes_tool_call", "nesting_depth", "parse_tool_calls", "prompt_ids",
           "read_json", "render_conversation", "render_prompt", "renders_tool_schemas", "short_repr", "tool_call_bodies", "tool_calls_of"]
