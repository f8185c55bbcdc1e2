"""Tokenizer loading that keeps a custom-trained fast tokenizer intact.

transformers 5's AutoTokenizer may swap in the architecture's own tokenizer class (Qwen2's
changes the pre-tokenizer, so ids differ). When the folder carries a `tokenizer.json`, load it as
`PreTrainedTokenizerFast`, which keeps exactly the trained pipeline.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    folder = Path(path)
    if (folder / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
