"""Loading the models of every role: a causal LM (actor, reference), a value model (critic) and a
sequence classifier (reward model), in the dtype and on the device a role computes in, a head the
folder lacks drawn from the run's seed. Each is proven against rlcore's forwards before it is
returned (`rlcore.workers.model_checks`): an architecture whose LM head, packed sequences or
score rlcore would read otherwise than its own forward is refused at load time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from rlcore.config import ModelConfig
from rlcore.workers.attention import use_packed_attention
from rlcore.workers.forward import NotASequenceClassifier, score_head, text_config
from rlcore.workers.model_checks import check_lm_head, check_packed_forward, check_sequence_scores

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def trained_dtype(model_cfg: ModelConfig) -> str:
    """The dtype a trained role (actor, critic) holds its parameters, gradients and optimizer state
    in: float32 master weights, whatever `model.dtype` computes in, unless `model.pure_bf16`."""
    return "bfloat16" if model_cfg.pure_bf16 else "float32"


def compute_precision(model_cfg: ModelConfig, mixed_precision: str = "none") -> str:
    """`shard_model`'s mixed_precision for a trained role: "bf16" (forward and backward in bf16 over
    the master weights) when `model.dtype` is bfloat16 or the role asks for bf16 mixed precision."""
    return "bf16" if model_cfg.dtype == "bfloat16" or mixed_precision == "bf16" else "none"


def load_causal_lm(
    path: str | Path, dtype: str, device: torch.device, gradient_checkpointing: bool = False, remove_padding: bool = True
) -> nn.Module:
    """A causal LM in `dtype` on `device`; refused (ValueError) when its LM head is one the
    log-prob path cannot reproduce (`check_lm_head`), or, with `remove_padding`, when packed
    sequences would change its outputs (`check_packed_forward`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    model = model.to(device)
    check_lm_head(model)
    if remove_padding:
        check_packed_forward(use_packed_attention(model))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


@contextmanager
def _rng_left_alone() -> Iterator[None]:
    """Inside, the CPU torch RNG may be drawn from (transformers initialises the weights a folder
    lacks from it); after, the caller's stream goes on as if nothing had drawn."""
    with torch.random.fork_rng(devices=[]):
        yield


def init_fresh_head(model: nn.Module, head: nn.Linear, seed: int) -> None:
    """A head the folder did not have, drawn from `seed`: normal weights (std the model's
    `initializer_range`, as transformers initialises one), zero bias. Never the process's RNG:
    a Ray worker's is seeded at random, so FSDP2 ranks would shard heads of different inits and
    no two runs would start alike."""
    std = float(getattr(text_config(model), "initializer_range", 0.02))
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
        if head.bias is not None:
            head.bias.zero_()


def load_value_model(
    path: str | Path, dtype: str, device: torch.device, gradient_checkpointing: bool = False, remove_padding: bool = True,
    seed: int = 0,
) -> nn.Module:
    """A causal LM backbone with a scalar head per token (verl's critic: token classification, 1 label).

    No dropout before the head (transformers' default for Llama-style classifiers is 10%): the
    values the critic is trained on must be the ones `compute_values` predicts, as in verl. A
    folder without a value head (a causal LM) gets a fresh one drawn from `seed` (`init_fresh_head`:
    `trainer.seed`, the same on every rank and run)."""
    config = AutoConfig.from_pretrained(Path(path), num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not transformers' load report: a missing value head is expected, said below
    try:
        with _rng_left_alone():
            model, info = AutoModelForTokenClassification.from_pretrained(
                Path(path), config=config, dtype=_DTYPES[dtype], local_files_only=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    name = next(n for n in ("score", "classifier") if isinstance(getattr(model, n, None), nn.Linear))  # transformers' names
    if any(name in k.split(".") for k in info.get("missing_keys", [])):
        init_fresh_head(model, getattr(model, name), seed)
        print(f"rlcore: critic: a new value head ({name}, one value per token, drawn from seed {seed}) on the "
              f"backbone of {path}; PPO trains it from there", file=sys.stderr, flush=True)
    model = model.to(device)
    if remove_padding:
        check_packed_forward(use_packed_attention(model))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def is_sequence_classifier(config: dict) -> bool:
    """A transformers config (as JSON) of a one-label sequence classifier."""
    architectures = config.get("architectures") or []
    labels = config.get("id2label")
    one_label = (len(labels) == 1) if isinstance(labels, dict) else config.get("num_labels", 1) == 1
    return any(str(a).endswith("ForSequenceClassification") for a in architectures) and one_label


def scored_pad_token_id(folder: str | Path, tokenizer_pad_token_id: int | None) -> int | None:
    """The pad token a reward model built from `folder` reads its scores by (transformers' rule: at
    the last token that is not it): a trained classifier's own, a backbone under a fresh head its
    tokenizer's (`tokenizer_pad_token_id`), as `open_reward_model`'s reader does."""
    config = AutoConfig.from_pretrained(Path(folder), local_files_only=True)
    pad = config.pad_token_id if is_sequence_classifier(config.to_dict()) else None
    pad = tokenizer_pad_token_id if pad is None else pad
    return None if pad is None else int(pad)


def load_sequence_classifier(
    path: str | Path,
    dtype: str,
    device: torch.device,
    *,
    key: str,
    new_head_ok: bool = False,
    pad_token_id: int | None = None,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    remove_padding: bool = True,
) -> nn.Module:
    """A reward model: transformers' `AutoModelForSequenceClassification` with one label, in
    `dtype` on `device`; the one place its model is built, for training and for scoring.

    A one-label sequence classifier at `path` keeps its trained score head. Anything else is
    refused (`NotASequenceClassifier`, naming `key`) unless `new_head_ok` (training with
    `algorithm.name: rm`): then `path` is a backbone (a causal LM, say) under a fresh score head
    (`init_fresh_head`, drawn from `seed`), and `pad_token_id` is written into its
    config so transformers' own forward reads the score where rlcore does. A model whose own
    forward scores otherwise than `sequence_scores` is refused too (`check_sequence_scores`)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{key}: {folder} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    trained_head = is_sequence_classifier(config.to_dict())
    if not trained_head and not new_head_ok:
        raise NotASequenceClassifier(
            f"{key}: {folder} is not a reward model: its config names {config.architectures or 'no architectures'} "
            f"with {config.num_labels} label(s), not a one-label *ForSequenceClassification model. Train one with "
            "algorithm.name=rm (it saves an HF folder AutoModelForSequenceClassification loads)")
    if not trained_head:
        config = AutoConfig.from_pretrained(folder, num_labels=1, local_files_only=True)
        config.pad_token_id = pad_token_id
    verbosity = hf_logging.get_verbosity()
    if not trained_head:  # transformers' report of the missing head, which is the point here
        hf_logging.set_verbosity_error()
    try:
        with _rng_left_alone():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                folder, config=config, dtype=_DTYPES[dtype], local_files_only=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    head = score_head(model)
    missing = [k for k in info.get("missing_keys", []) if "score" in k.split(".")]
    if trained_head and missing:
        raise NotASequenceClassifier(f"{key}: {folder} has no trained score head (missing {missing}); "
                                     "it is not a reward model")
    if not trained_head:
        init_fresh_head(model, head, seed)
    model = model.to(device)
    check_sequence_scores(model, key=key)
    if remove_padding:
        check_packed_forward(use_packed_attention(model))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
