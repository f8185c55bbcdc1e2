"""A user's own model, tokenizer, data and reward, built in seconds without downloads.

What a user brings who post-trains a Qwen2.5-Instruct-like model: a Qwen2 model with grouped-query
attention and tied embeddings; a byte-level BPE tokenizer with real merges (trained here with the
`tokenizers` library on the task's own text) and a ChatML chat template; a generation_config
listing two end tokens (`<|im_end|>`, the tokenizer's EOS, and `<|endoftext|>`); SFT data in
verl's SFT schema (prompt/response columns), RL data in verl's schema under a data source no
built-in scorer knows; and a reward file with verl's `compute_score` signature.

The task: name the color of a thing ("What color is the banana?" -> "yellow"). The SFT teacher
is flawed: for each thing it gives the right color with a probability between 0.25 and 0.75 and a
fixed wrong one otherwise, so the SFT model is right on about half of the held-out prompts
(greedy) and RL has something to fix. The teacher ends its answers with `<|endoftext|>`, the end
token that is not the tokenizer's EOS: a model that learns it stops with the *second* end token,
which is what a trainer that honours only the tokenizer's EOS gets wrong.

The tokenizer is trained with Qwen2's own pre-tokenizer (and NFC), which is what `AutoTokenizer`
rebuilds for a `qwen2` folder, so the tokenizer.json and AutoTokenizer give the same ids;
`build_mismatched_tokenizer_folder` makes the folder where they differ (a BPE whose merges span
spaces).
"""

from __future__ import annotations

import json
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = SPECIALS
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DATA_SOURCE = "own/colors"  # no built-in scorer: the run needs reward.function

COLORS = {
    "banana": "yellow", "lemon": "yellow", "sky": "blue", "ocean": "blue", "grass": "green", "leaf": "green",
    "lime": "green", "cherry": "red", "tomato": "red", "blood": "red", "snow": "white", "milk": "white",
    "cloud": "white", "coal": "black", "night": "black", "crow": "black", "carrot": "orange", "pumpkin": "orange",
    "plum": "purple", "grape": "purple", "flamingo": "pink", "ash": "gray", "soil": "brown", "bark": "brown",
}
TRAIN_PHRASES = ("What color is the {x}?", "Name the color of the {x}.", "Which color does the {x} have?")
VAL_PHRASES = ("Tell me the color of a {x}.", "What is the color of the {x}?")

REWARD_FILE = textwrap.dedent('''\
    """The user's reward: an exact answer scores 1 (verl's compute_score signature)."""


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip() == ground_truth else 0.0
    ''')


@dataclass(frozen=True)
class OwnModel:
    root: Path
    model_dir: Path  # untrained Qwen2 + tokenizer + generation_config with two end tokens
    sft_file: Path
    train_file: Path
    val_file: Path
    reward_file: Path

    @property
    def reward_spec(self) -> str:
        return f"{self.reward_file}:compute_score"


def train_bpe(texts: list[str], vocab_size: int = 512, qwen_pretokenizer: bool = True):
    """A byte-level BPE trained on `texts`, as a transformers tokenizer with ChatML.

    `qwen_pretokenizer`: Qwen2's split regex then byte-level, and NFC, exactly what AutoTokenizer
    rebuilds for a qwen2 folder; False: byte-level over the whole text (merges span spaces).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    if qwen_pretokenizer:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
                                   chat_template=CHATML, clean_up_tokenization_spaces=False, model_max_length=512)


def save_tokenizer(tokenizer, folder: Path) -> None:
    """The tokenizer files, naming the class AutoTokenizer builds for a qwen2 folder anyway."""
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_file.write_text(json.dumps(config, indent=2))


def save_qwen2_model(tokenizer, folder: Path, seed: int = 0, hidden_size: int = 128, layers: int = 2,
                     initializer_range: float = 0.02) -> None:
    """A seeded, untrained Qwen2 (GQA: 4 query heads over 2 KV heads, head dim 32; tied
    embeddings) with the tokenizer, and a generation_config listing both end tokens."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    end, eot = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rope_theta=10000.0, use_sliding_window=False, bos_token_id=eot, eos_token_id=end, pad_token_id=eot,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[end, eot], pad_token_id=eot)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)


def prompt(thing: str, phrase: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": phrase.format(x=thing)}]


def rl_rows(phrases: tuple[str, ...], split: str) -> list[dict]:
    return [{"prompt": prompt(thing, phrase), "data_source": DATA_SOURCE,
             "reward_model": {"ground_truth": color, "style": "rule"},
             "extra_info": {"split": split, "thing": thing}}
            for phrase in phrases for thing, color in COLORS.items()]


def sft_rows(n: int, seed: int) -> list[dict]:
    """The flawed teacher's answers (see the module docstring), in verl's prompt/response schema."""
    rng = random.Random(seed)
    colors = sorted(set(COLORS.values()))
    things = sorted(COLORS)
    p_right = {t: rng.uniform(0.25, 0.75) for t in things}
    decoy = {t: rng.choice([c for c in colors if c != COLORS[t]]) for t in things}
    rows = []
    for _ in range(n):
        thing = rng.choice(things)
        answer = COLORS[thing] if rng.random() < p_right[thing] else decoy[thing]
        rows.append({"prompt": prompt(thing, rng.choice(TRAIN_PHRASES)), "response": answer + ENDOFTEXT})
    return rows


def corpus() -> list[str]:
    """The text the BPE is trained on: every prompt rendered as ChatML, followed by each color."""
    return [f"{IM_START}user\n{prompt(t, p)[0]['content']}{IM_END}\n{IM_START}assistant\n{color}{ENDOFTEXT}"
            for p in TRAIN_PHRASES + VAL_PHRASES for t in COLORS for color in sorted(set(COLORS.values()))]


def build_own_model(root: Path, seed: int = 0, sft_rows_n: int = 4096) -> OwnModel:
    """Everything under `root` (tokenizer training and model init: about a second)."""
    from rlcore.data.io import write_rows

    root = Path(root)
    model_dir = root / "model"
    tokenizer = train_bpe(corpus())
    save_qwen2_model(tokenizer, model_dir, seed=seed)
    reward_file = root / "my_reward.py"
    reward_file.write_text(REWARD_FILE)
    return OwnModel(
        root=root, model_dir=model_dir,
        sft_file=write_rows(sft_rows(sft_rows_n, seed + 1), root / "data" / "sft.parquet"),
        train_file=write_rows(rl_rows(TRAIN_PHRASES, "train"), root / "data" / "train.parquet"),
        val_file=write_rows(rl_rows(VAL_PHRASES, "val"), root / "data" / "val.parquet"),
        reward_file=reward_file,
    )


def build_mismatched_tokenizer_folder(folder: Path, with_weights: bool = True) -> Path:
    """A qwen2 folder whose tokenizer.json (merges spanning spaces) tokenizes the task's prompts
    one way as the file and another way through AutoTokenizer (Qwen2Tokenizer's pre-tokenizer)."""
    tokenizer = train_bpe(corpus(), qwen_pretokenizer=False)
    if with_weights:
        save_qwen2_model(tokenizer, folder, hidden_size=64, layers=1)
    else:
        from transformers import Qwen2Config

        Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(folder)
        save_tokenizer(tokenizer, folder)
    return folder
