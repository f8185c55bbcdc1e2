"""Supervised fine-tuning data in verl's SFT schema, tokenized with the loss on the response only,
rendered exactly as RL renders the same messages (`rlcore.chat`).

Two row shapes, chosen per file by its columns (keys configurable, `data.*_key`):

- prompt/response: `prompt` is chat messages or a string, rendered exactly as RL prompts are
  (`rlcore.chat.prompt_ids`: the chat template with its generation prompt and the tools' schemas;
  a string as is), so the model learns to answer the prompt it will be sampled with; `response`
  is a string, followed by the tokenizer's EOS unless it already ends with one of the model's end
  tokens. Labels cover the response (and that EOS).
- messages (verl's multi-turn schema): a conversation `[{role, content}, ...]` rendered as an agent
  rollout holds it (`rlcore.chat.conversation_ids`): the messages before the first assistant turn
  are the RL prompt (tools included), every assistant turn is trained on (its text and the end
  token that closes it; OpenAI-style `tool_calls` as the text the model writes for them), and the
  messages between (tool results, user turns) are context, as are the template's own tokens.

Tool schemas: `tools` (those of `data.tools`, as RL's `rollout.agent.tools` gives them), or a row's
own `tools` column (verl's `tools_key`: a list of schemas or its JSON text), which wins for its row.
The calls a row trains (OpenAI `tool_calls`, or hermes `<tool_call>` text in an assistant turn or
a response) are read as the agent loop reads them (`rlcore.chat.parse_tool_calls`): a call the loop
could not read (not JSON, arguments nested deeper than it allows), a call to a tool that is not
among the row's tools, and a call in a row that has no tools although the template would list
them in the prompt (the model would learn calls against a prompt that lists no tools) make the row
bad.

Bad rows are reported all at once, each naming file, row and field, one problem shared by many
rows as one line naming the first rows and the count (or skipped and counted: `on_bad_row`).

`collate_sft` makes a batch of examples the `Batch` the actor's supervised update takes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jinja2 import TemplateError

from rlcore.chat import (
    OPEN_TAG,
    ChatTurns,
    conversation_ids,
    has_chat_template,
    nesting_depth,
    parse_tool_calls,
    prompt_ids,
    renders_tool_schemas,
    short_repr,
    tool_calls_of,
)
from rlcore.data.io import peek_fields, read_rows
from rlcore.data.schema import ROLES, BadRowPolicy, DataError, DatasetError, DataValidationError, UnreadableRow
from rlcore.protocol import Batch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label of a token the loss skips (prompt, padding), as in transformers
Truncation = Literal["error", "drop", "right"]
MAX_SCHEMA_DEPTH = 64  # a row's tool schemas nest no deeper (a tool's parameters need far less)
NO_TOOLS = ("calls tools, but no tools are given (data.tools is empty and the row has no '{key}' of its own): the "
            "chat template lists the tools in the prompt, so the model would learn calls against a prompt that lists none")


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where the loss does not look
    file: str = ""
    row: int = -1

    @property
    def num_targets(self) -> int:
        """Tokens the loss is taken on (a label at position t is predicted from the tokens before it)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int) -> Batch:
    """Examples as one right-padded `Batch` in the RL layout with a one-token prompt, which the
    log-prob path (`rlcore.workers.forward`) reads as it reads RL responses: `input_ids`,
    `attention_mask`, `position_ids` [N, T]; `responses` = every token after the first [N, T-1],
    and `response_mask` = 1 on those with a label (each is predicted from the tokens before it)."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        attention_mask[i, : len(e.input_ids)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return Batch(tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                          "responses": input_ids[:, 1:].clone(), "response_mask": (labels[:, 1:] != IGNORE_INDEX).float()})


def tokenize_prompt_response(prompt: str | list[dict[str, str]], response: str, tokenizer: Any,
                             apply_chat_template: bool = True, end_ids: Sequence[int] | None = None,
                             tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a prompt/response row; labels are IGNORE_INDEX on the prompt.

    The response is followed by the tokenizer's EOS so the model learns to stop, unless it already
    ends with one of `end_ids` (default: the EOS alone), e.g. "yellow<|endoftext|>".
    """
    _, p_ids = prompt_ids(prompt, tokenizer, apply_chat_template, tools)
    r_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    ends = set(end_ids) if end_ids is not None else {eos}
    if eos is not None and not (r_ids and r_ids[-1] in ends):
        r_ids.append(eos)
    return p_ids + r_ids, [IGNORE_INDEX] * len(p_ids) + r_ids


def tokenize_messages(messages: list[dict[str, Any]], tokenizer: Any, end_ids: Sequence[int] | None = None,
                      tools: list[dict[str, Any]] | None = None, turns: ChatTurns | None = None) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a conversation, as an agent rollout of its prompt holds it
    (`rlcore.chat.conversation_ids`): labels on each assistant turn's tokens and end token only.
    `end_ids`: the model's end tokens (default: the EOS); `turns`: the tokenizer's `ChatTurns`, when
    the caller keeps one. Raises ValueError when there is no assistant turn, no chat template, or
    the conversation cannot be rendered as a rollout."""
    if not has_chat_template(tokenizer):
        raise ValueError("a messages row needs a chat template (the tokenizer has none)")
    ends = list(end_ids) if end_ids is not None else [tokenizer.eos_token_id]
    ids, trained = conversation_ids(messages, turns or ChatTurns(tokenizer), ends, tools)
    return ids, [t if on else IGNORE_INDEX for t, on in zip(ids, trained)]


def _messages_problem(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of {{role, content}} messages, got {type(value).__name__}"
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"message {j}: expected {{'role': str, 'content': str}}, got {short_repr(m)}"
        if m["role"] not in ROLES:
            return f"message {j}: unknown role {short_repr(m['role'])} (roles: {', '.join(ROLES)})"
        calls = m.get("tool_calls")
        if calls is not None and m["role"] != "assistant":
            return f"message {j}: a {m['role']} message with tool_calls (only assistant turns call tools)"
        content_ok = isinstance(m.get("content"), str) or (m.get("content") is None and bool(calls))
        if not content_ok:
            return f"message {j}: expected {{'role': str, 'content': str}}, got {short_repr(m)}"
        for key in ("name", "tool_call_id"):  # a tool message's: which call it answers
            if m.get(key) is not None and not isinstance(m[key], str):
                return f"message {j}: {key}: expected a string, got {short_repr(m[key])}"
    return None


def _names_a_function(schema: Any) -> bool:
    fn = schema.get("function", schema) if isinstance(schema, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str)


def row_tools(value: Any) -> list[dict[str, Any]] | None:
    """A row's own tool schemas (verl's `tools` column): a list of OpenAI-style schemas or its JSON
    text; None or empty: the row has none. ValueError when it is neither."""
    if value is None or (isinstance(value, (str, list)) and not value):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as e:
            raise ValueError(f"not JSON ({str(e)[:120]})") from None
    if nesting_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(_names_a_function(t) for t in value):
        raise ValueError(f"expected a list of {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}} "
                         f"schemas, got {short_repr(value, 120)}")
    return value


def tool_names(schemas: Sequence[dict[str, Any]]) -> set[str]:
    """The names of the tools `schemas` describe (OpenAI's `{"function": {"name"}}` or a bare `{"name"}`)."""
    return {str(t.get("function", t)["name"]) for t in schemas}


def trained_calls(messages: Sequence[dict[str, Any]], label: str = "message {}") -> list[str]:
    """The names of the tools the assistant turns of `messages` call, read as the agent loop reads
    them: OpenAI `tool_calls` (`rlcore.chat.tool_calls_of`) and hermes `<tool_call>` text in their
    content (`rlcore.chat.parse_tool_calls`). ValueError naming the message (`label` with its index)
    of a call the loop could not read."""
    names: list[str] = []
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            names += [name for name, _ in tool_calls_of(m)]
        except ValueError as e:
            raise ValueError(f"{label.format(j)}: {e}") from None
        content = m.get("content")
        if isinstance(content, str) and OPEN_TAG in content:
            for call in parse_tool_calls(content):
                if call.error is not None:
                    raise ValueError(f"{label.format(j)}: a <tool_call> the agent loop cannot read ({call.error})")
                names.append(call.name)
    return names


def check_calls(names: Sequence[str], schemas: Sequence[dict[str, Any]] | None,
                lists_tools: Callable[[], bool], tools_key: str = "tools") -> str | None:
    """Why the calls `names` of a row cannot be trained with the tools `schemas` (None: they can):
    a tool not among them, or no tools at all where the prompt would list them (`lists_tools()`,
    asked only then; `tools_key`: the column a row's own tools are in)."""
    if not names:
        return None
    if not schemas:
        return NO_TOOLS.format(key=tools_key) if lists_tools() else None
    given = tool_names(schemas)
    unknown = next((n for n in names if n not in given), None)
    if unknown is None:
        return None
    shown = ", ".join(sorted(given)[:8]) + (", ..." if len(given) > 8 else "")
    return f"calls {short_repr(unknown)}, which is not among the tools given ({shown})"


class RowsError(DataError):
    """One problem that several rows of a file share, as one line naming the first rows and the count."""

    SHOWN = 5

    def __init__(self, file: str, rows: Sequence[int], field: str, message: str) -> None:
        super().__init__(file, rows[0], field, message)
        self.rows = list(rows)
        listed = ", ".join(str(r) for r in self.rows[:self.SHOWN]) + (", ..." if len(self.rows) > self.SHOWN else "")
        self.args = (f"{self.file}: {len(self.rows)} rows ({listed}): field '{field}': {message}",)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):  # type: ignore[override]
        return (RowsError, (self.file, self.rows, self.field, self.message))


def grouped(errors: Sequence[DataError]) -> list[DataError]:
    """`errors` with those that say the same of the same field of one file merged into one
    `RowsError` (at the place of the first), so 200 rows without tools are one line, not 200."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for e in errors:
        rows.setdefault((e.file, e.field, e.message), []).append(e.row)
    out: list[DataError] = []
    for e in errors:
        same = rows.pop((e.file, e.field, e.message), None)
        if same is not None:
            out.append(e if len(same) == 1 else RowsError(e.file, same, e.field, e.message))
    return out


class SFTDataset:
    """Every usable row of `files`, tokenized: `examples` in file order, `stats` counting the rest."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, *, max_length: int,
                 prompt_key: str = "prompt", response_key: str = "response", messages_key: str = "messages",
                 truncation: Truncation = "error", apply_chat_template: bool = True, on_bad_row: BadRowPolicy = "error",
                 end_ids: Sequence[int] | None = None, tools: list[dict[str, Any]] | None = None,
                 tools_key: str = "tools") -> None:
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ValueError("SFTDataset needs at least one file")
        self.files = [str(f) for f in files]
        self.tokenizer, self.apply_chat_template, self.end_ids, self.tools = tokenizer, apply_chat_template, end_ids, tools
        self.prompt_key, self.response_key, self.messages_key, self.tools_key = prompt_key, response_key, messages_key, tools_key
        self.examples: list[SFTExample] = []
        self.stats = {"rows_read": 0, "bad_rows": 0, "too_long": 0, "truncated": 0, "kept": 0}
        errors: list[DataError] = []
        too_long: list[DataError] = []
        self._turns: ChatTurns | None = None  # made at the first row that needs it (a row's error if there is no template)
        self._renders_schemas: bool | None = None
        for file in self.files:
            fields = peek_fields(file)
            multi_turn = messages_key in fields
            if not multi_turn and not (prompt_key in fields and response_key in fields):
                raise DatasetError(f"{file}: an SFT file needs a '{messages_key}' column, or '{prompt_key}' and "
                                   f"'{response_key}' (it has {', '.join(fields)}; data.*_key names them)")
            rows = read_rows(file, keep_unreadable=True)
            self.stats["rows_read"] += len(rows)
            for i, row in enumerate(rows):
                if isinstance(row, UnreadableRow):
                    errors.extend(row.errors)
                    continue
                try:
                    ids, labels = self._tokenize(row, file, i, multi_turn)
                except DataError as err:
                    errors.append(err)
                    continue
                cut = len(ids) > max_length
                if cut:
                    if truncation != "right":
                        too_long.append(DataError(file, i, messages_key if multi_turn else f"{prompt_key}+{response_key}",
                                                  f"{len(ids)} tokens, longer than max_length={max_length}"))
                        continue
                    ids, labels = ids[:max_length], labels[:max_length]
                example = SFTExample(ids, labels, file, i)
                if example.num_targets == 0:
                    errors.append(DataError(file, i, response_key, f"no response token within max_length={max_length}"))
                    continue
                self.stats["truncated"] += cut
                self.examples.append(example)
        self.stats["bad_rows"] = len({(e.file, e.row) for e in errors})
        self.stats["too_long"] = len(too_long)
        if errors and on_bad_row == "error":
            raise DataValidationError(grouped(errors))
        if too_long and truncation == "error":
            raise DataValidationError(too_long)
        if errors:
            shown = grouped(errors)
            log.warning("skipped %d bad SFT row(s) (data.on_bad_row=skip): %s%s", self.stats["bad_rows"],
                        "; ".join(str(e) for e in shown[:3]), f"; and {len(shown) - 3} more problems" if len(shown) > 3 else "")
        if too_long:
            log.warning("dropped %d SFT row(s) longer than max_length=%d; first: %s", len(too_long), max_length, too_long[0])
        if self.stats["truncated"]:
            log.warning("cut %d SFT row(s) to max_length=%d from the right (their end token is lost)",
                        self.stats["truncated"], max_length)
        self.stats["kept"] = len(self.examples)
        if not self.examples:
            raise DatasetError(f"no usable SFT rows in {self.files} (stats: {self.stats})")

    def _lists_tools(self) -> bool:
        """Whether the template lists tools in a prompt (`rlcore.chat.renders_tool_schemas`, asked once)."""
        if self._renders_schemas is None:
            self._renders_schemas = renders_tool_schemas(self.tokenizer)
        return self._renders_schemas

    @property
    def turns(self) -> ChatTurns:
        """The tokenizer's `ChatTurns` (renders its template a few times: made once)."""
        if self._turns is None:
            self._turns = ChatTurns(self.tokenizer)
        return self._turns

    def _tokenize(self, row: Any, file: str, i: int, multi_turn: bool) -> tuple[list[int], list[int]]:
        """(ids, labels) of row `i` of `file`; a `DataError` naming the row and field of whatever is
        wrong with it (its shape, its tools, the calls it trains, or what the template makes of it)."""
        key = self.messages_key if multi_turn else self.prompt_key
        if not isinstance(row, dict):
            raise DataError(file, i, "<row>", f"expected an object, got {type(row).__name__}")
        schemas = self._row_schemas(row, file, i)
        try:
            if multi_turn:
                return self._conversation(row.get(self.messages_key), schemas, file, i)
            return self._prompt_response(row.get(self.prompt_key), row.get(self.response_key), schemas, file, i)
        except DataError:
            raise
        except RecursionError:
            raise DataError(file, i, key, "nested too deep for the chat template to render") from None
        except (ValueError, TypeError, KeyError, TemplateError) as err:  # the template, or a call, refused the row
            raise DataError(file, i, key, f"{err}" if isinstance(err, ValueError) else f"{type(err).__name__}: {err}") from None

    def _row_schemas(self, row: dict[str, Any], file: str, i: int) -> list[dict[str, Any]] | None:
        """The tools of a row: its own column's (read wherever a row has it: a JSON-lines row may
        when the file's first row does not), else `data.tools`'."""
        if self.tools_key not in row:
            return self.tools
        try:
            return row_tools(row[self.tools_key]) or self.tools
        except ValueError as err:
            raise DataError(file, i, self.tools_key, str(err)) from None

    def _conversation(self, messages: Any, schemas: list[dict[str, Any]] | None, file: str, i: int) -> tuple[list[int], list[int]]:
        key = self.messages_key
        problem = _messages_problem(messages) or check_calls(trained_calls(messages), schemas, self._lists_tools, self.tools_key)
        if problem is not None:
            raise DataError(file, i, key, problem)
        return tokenize_messages(messages, self.tokenizer, self.end_ids, schemas, self.turns)

    def _prompt_response(self, prompt: Any, response: Any, schemas: list[dict[str, Any]] | None, file: str,
                         i: int) -> tuple[list[int], list[int]]:
        if not isinstance(prompt, str) and _messages_problem(prompt) is not None:
            raise DataError(file, i, self.prompt_key, f"expected a string or messages: {_messages_problem(prompt)}")
        if not isinstance(response, str) or not response:
            raise DataError(file, i, self.response_key, f"expected a non-empty string, got {short_repr(response)}")
        templated = not isinstance(prompt, str) and self.apply_chat_template and has_chat_template(self.tokenizer)
        try:
            names = trained_calls([{"role": "assistant", "content": response}], label="the response")
        except ValueError as err:
            raise DataError(file, i, self.response_key, str(err)) from None
        problem = check_calls(names, schemas, lambda: templated and self._lists_tools(), self.tools_key)
        if problem is not None:
            raise DataError(file, i, self.response_key, problem)
        return tokenize_prompt_response(prompt, response, self.tokenizer, self.apply_chat_template, self.end_ids, schemas)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]


__all__ = ["IGNORE_INDEX", "RowsError", "SFTDataset", "SFTExample", "check_calls", "collate_sft", "grouped", "row_tools",
           "tokenize_messages", "tokenize_prompt_response", "tool_names", "trained_calls"]
