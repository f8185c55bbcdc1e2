"""A tiny character-level tokenizer for the built-in example, made with `tokenizers`.

Why character level: arithmetic is learned far faster when every digit is its own token, and a
WordLevel vocabulary built from a fixed character list is deterministic (no BPE training).
`####` is one token so the GSM8K-style answer marker costs a single step to generate.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT, SYSTEM, END]
ANSWER_MARK = "####"

# One user turn per message; the generation prompt opens the assistant turn. The assistant turn
# is closed by EOS (what the model learns to emit), so a response is "#### 47</s>".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _vocab() -> dict[str, int]:
    """Specials first (fixed ids 0..7), then the answer marker, then printable ASCII + newline."""
    tokens = [*SPECIAL_TOKENS, ANSWER_MARK]
    tokens += [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the in-memory tokenizer (deterministic: no training involved)."""
    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "####" first, then any single character (incl. newline): isolated pieces, nothing dropped.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"####|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


# ----------------------------------------------------------------------------- the tool task's tokenizer
# The tool example (`rlcore.example.tool_task`) talks to a calculator in the hermes format, so its
# tokenizer adds a tool role and the tool-call vocabulary. A separate tokenizer: the arithmetic
# example's vocabulary and template (and so its pinned weights) stay exactly as they are.
TOOL = "<|tool|>"
TOOL_SPECIAL_TOKENS = [*SPECIAL_TOKENS, TOOL]
# Pieces a BPE vocabulary would have merged: the call markers and the JSON keys of the one tool, so a
# call costs ~25 decoding steps instead of ~70 (plain characters otherwise, digits included).
TOOL_WORDS = ["<tool_call>", "</tool_call>", '"name"', '"arguments"', '"calculator"', '"expression"']

# As CHAT_TEMPLATE, plus tool turns (`<|tool|>result<|end|>`). An assistant turn's content is what the
# model wrote, tool calls included (`<tool_call>{...}</tool_call>`); tool schemas are not rendered
# (the tiny model knows its one tool from its warm start).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '<|tool|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tool task's tokenizer: specials (ids 0..8), the answer marker and `TOOL_WORDS` as single
    tokens, then printable ASCII + newline, one token per character (deterministic, no training)."""
    tokens = [*TOOL_SPECIAL_TOKENS, ANSWER_MARK, *TOOL_WORDS]
    tokens += [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    words = "|".join(w.replace('"', r"\"") for w in [ANSWER_MARK, *TOOL_WORDS])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(words + r"|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(TOOL_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END, TOOL],
        padding_side="left",
        chat_template=TOOL_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
