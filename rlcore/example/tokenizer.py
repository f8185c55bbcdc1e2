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
