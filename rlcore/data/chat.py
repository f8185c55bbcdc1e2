"""Turning a dataset prompt (chat messages or a plain string) into the text the model sees.

One function shared by the RL dataset, the SFT trainer and evaluation, so a model is trained and
scored on exactly the prompt rendering it will be sampled with.
"""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


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
