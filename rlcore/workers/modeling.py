"""Model loading and the forward passes shared by actor, reference, critic and reward model.

Log-probs are computed from the last hidden state and the LM head through
`rlcore.triton_kernels` in token chunks, so the `[tokens, vocab]` float32 logits of a whole
batch never exist at once. With `remove_padding` (config `model.use_remove_padding`, on by default)
the backbone runs on the micro-batch's real tokens packed into one row (`rlcore.workers.packed`)
with packed-sequence attention (`rlcore.workers.attention`), and the head only on the hidden
states that predict real response tokens; a model on which that differs from the padded forward is
refused when it is loaded (`check_packed_forward`). The head is applied with the model's own semantics (bias, logit
scale, final soft-cap; `lm_head_semantics`), and a model whose forward makes its logits some other
way is refused when it is loaded (`check_lm_head`), so the log-probs are those the model defines.
The reward model (a sequence classifier) is read the same way: its score head on the hidden state
of each sequence's last non-pad token, packed, checked at load against the model's own forward
(`check_sequence_scores`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from rlcore.config import ModelConfig
from rlcore.protocol import Batch
from rlcore.triton_kernels import fused_token_logprobs
from rlcore.workers.attention import SEQUENCE_PARALLEL_KWARG, prompt_sharing, use_packed_attention
from rlcore.workers.packed import PackedRows, pack_rows, token_tally
from rlcore.workers.ulysses import SequenceParallel, sequence_parallel_of

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
    std = float(getattr(_text_config(model), "initializer_range", 0.02))
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


class NotASequenceClassifier(ValueError):
    """A reward model folder that is not a trained one-label sequence classifier; names the key."""


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


def score_head(model: nn.Module) -> nn.Linear:
    """The one-output linear score head of a sequence classifier (transformers' `score`). With
    LoRA it is peft's wrapper of a head trained in full beside the adapter: the copy its forward
    runs (the trained one; the original with the adapter disabled)."""
    head = getattr(model, "score", None)
    if isinstance(head, nn.Module) and not isinstance(head, nn.Linear):
        from peft.utils.other import ModulesToSaveWrapper

        if isinstance(head, ModulesToSaveWrapper):
            active = head.active_adapters
            head = head.original_module if head.disable_adapters or not active else head.modules_to_save[active[0]]
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise NotASequenceClassifier(f"{type(model).__name__}: no one-output linear `score` head (got "
                                     f"{type(head).__name__}); rlcore reads reward models with transformers' "
                                     "generic sequence-classification head")
    return head


def _pad_id(model: nn.Module) -> int | None:
    pad = _text_config(model).pad_token_id
    return None if pad is None else int(pad)


def last_scored_index(ids: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Per sequence of the packed row `ids` [T] (sequence i at `starts[i]`, `lens[i]` tokens), the
    position whose hidden state scores it: its last token that is not `pad_token_id` (the rule of
    transformers' sequence classifiers; its first token if every one is), or its last token when
    the model has no pad token."""
    ends = starts + lens - 1
    if pad_token_id is None:
        return ends
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), lens)
    positions = torch.arange(ids.numel(), device=ids.device)
    candidates = torch.where(ids != pad_token_id, positions, starts[seq_of])
    return starts.clone().scatter_reduce(0, seq_of, candidates, reduce="amax", include_self=True)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    remove_padding: bool = True) -> torch.Tensor:
    """The reward model's score of each right-padded row, [N] float32 (FSDP-sharded: through the
    forward method `shard_model` registers, so the root's parameters are gathered around it)."""
    fn = getattr(model, "rlcore_sequence_scores", None)
    if fn is not None:
        return fn(input_ids, attention_mask, remove_padding=remove_padding)
    return forward_sequence_scores(model, input_ids, attention_mask, remove_padding=remove_padding)


def forward_sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                            remove_padding: bool = True) -> torch.Tensor:
    """The computation behind `sequence_scores`: the backbone on the real tokens (packed into one
    row, or the padded batch), the score head only on each sequence's scored hidden state."""
    pad = _pad_id(model)
    lens = attention_mask.sum(-1)
    if remove_padding:
        packed = pack_rows(attention_mask, 0)
        hidden = _packed_forward(_backbone(model), model, input_ids, packed, None).last_hidden_state[0]  # no sequence parallelism
        device = input_ids.device
        seq_lens = torch.tensor(packed.seq_lens, dtype=torch.long, device=device)
        scored = last_scored_index(packed.pack(input_ids)[0], packed.cu_seqlens[:-1].long(), seq_lens, pad)
        sequence_of_row = torch.empty_like(scored)  # the packing orders sequences by length, not by row
        sequence_of_row[torch.tensor(packed.sequence_rows, device=device)] = torch.arange(scored.numel(), device=device)
        picked = hidden.index_select(0, scored.index_select(0, sequence_of_row))
    else:
        n, width = input_ids.shape
        out = _backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        token_tally(model).add(input_ids.numel(), lens.sum())
        starts = torch.arange(n, device=input_ids.device) * width
        whole_rows = torch.full_like(lens, width)  # transformers' rule looks at every position of a row
        flat = last_scored_index(input_ids.reshape(-1), starts, whole_rows if pad is not None else lens, pad)
        picked = out.last_hidden_state.reshape(n * width, -1).index_select(0, flat)
    head = score_head(model)
    bias = head.bias.to(picked.dtype) if head.bias is not None else None
    return F.linear(picked, head.weight.to(device=picked.device, dtype=picked.dtype), bias).squeeze(-1).float()


@torch.no_grad()
def check_sequence_scores(model: nn.Module, *, key: str, lengths: tuple[int, ...] = (5, 3)) -> None:
    """Refuse (ValueError naming `key`) a sequence classifier whose own forward scores two
    right-padded probe sequences otherwise than `sequence_scores` reads them (packed and padded):
    the scores rlcore trains with and rewards by must be the ones `from_pretrained` users get.
    Tolerance: 1e-4 (float32) or 3e-2 (bf16) of the largest score."""
    embeddings = model.get_input_embeddings().weight
    vocab, device = embeddings.shape[0], embeddings.device
    pad = _pad_id(model)
    width = max(lengths)
    ids = (torch.arange(len(lengths) * width, device=device).view(len(lengths), width) * 7919 + 11) % vocab
    if pad is not None:
        ids = torch.where(ids == pad, (ids + 1) % vocab, ids)
    mask = (torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()
    if pad is not None:
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    was_training = model.training
    model.eval()
    try:
        own = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().reshape(-1)
        ours = [forward_sequence_scores(model, ids, mask, remove_padding=packed) for packed in (False, True)]
    finally:
        model.train(was_training)
        token_tally(model).take()  # the probe is not a step's work
    low_precision = embeddings.dtype != torch.float32
    tol = (3e-2 if low_precision else 1e-4) * max(1.0, own.abs().max().item())
    diff = max((own - o).abs().max().item() for o in ours)
    if not diff <= tol:
        raise ValueError(
            f"{key}: {type(model).__name__}'s forward scores differently from rlcore's reading of a reward model "
            f"(the score head on the last non-pad token; max difference {diff:.3g} on two probe sequences): "
            "this architecture is not supported as a reward model")


@dataclass(frozen=True)
class LMHead:
    """How a causal LM turns its last hidden state h into logits: (h @ W.T + b) * logit_scale,
    then softcap * tanh(. / softcap) when soft-capped."""

    has_bias: bool
    logit_scale: float = 1.0
    softcap: float | None = None


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def lm_head_semantics(model: nn.Module) -> LMHead:
    """The head semantics of `model`, read from the attributes transformers' forwards use: the
    output embedding's bias (Phi, GPT-J), `logit_scale` (Cohere), `config.logits_scaling`
    (Granite: logits are divided by it) and `config.final_logit_softcapping` (Gemma 2/3).

    Raises ValueError, naming the model class and attribute, for a head it cannot express."""
    cls = type(model).__name__
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or weight is None or weight.dim() != 2:
        raise ValueError(f"{cls}: get_output_embeddings() is {type(head).__name__}, not an nn.Linear LM head; "
                         "rlcore's log-prob path needs a [vocab, hidden] head weight")
    scale = 1.0
    logit_scale = getattr(model, "logit_scale", None)
    if isinstance(logit_scale, torch.Tensor):
        raise ValueError(f"{cls}.logit_scale is a tensor (a learned logit scale); rlcore's log-prob path "
                         "supports a constant logit scale only")
    if logit_scale is not None:
        scale *= float(logit_scale)
    config = _text_config(model)
    logits_scaling = getattr(config, "logits_scaling", None)
    if logits_scaling is not None:
        scale /= float(logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LMHead(has_bias=head.bias is not None, logit_scale=scale, softcap=None if softcap is None else float(softcap))


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Full float32 logits of `hidden` [..., H] under `lm_head_semantics` (for checks and tests;
    the training path never materialises them)."""
    spec = lm_head_semantics(model)
    head = model.get_output_embeddings()
    logits = hidden.float() @ head.weight.float().T
    if spec.has_bias:
        logits = logits + head.bias.float()
    logits = logits * spec.logit_scale
    if spec.softcap is not None:
        logits = spec.softcap * torch.tanh(logits / spec.softcap)
    return logits


@torch.no_grad()
def check_lm_head(model: nn.Module, probe_tokens: int = 8) -> LMHead:
    """Refuse (ValueError naming the model class) a model whose own forward computes logits other
    than `lm_head_semantics` says, checked on one short probe sequence: the log-probs rlcore trains
    on would not be the model's. Tolerance: 1e-4 (float32) or 3e-2 (bf16) of the largest logit."""
    spec = lm_head_semantics(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    ids = (torch.arange(probe_tokens, device=device) * 7919 % vocab).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        hidden = _backbone(model)(input_ids=ids, use_cache=False).last_hidden_state
        own = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    ours = head_logits(model, hidden)
    low_precision = model.get_output_embeddings().weight.dtype != torch.float32
    tol = (3e-2 if low_precision else 1e-4) * max(1.0, own.abs().max().item())
    diff = (own - ours).abs().max().item()
    if not diff <= tol:
        raise ValueError(
            f"{type(model).__name__}: its forward computes logits differently from the LM head rlcore applies "
            f"(lm_head weight{' + bias' if spec.has_bias else ''}, logit scale {spec.logit_scale:g}, soft-cap "
            f"{spec.softcap}): max difference {diff:.3g} on a probe sequence. Its log-probs would be wrong; "
            "this architecture is not supported by rlcore's log-prob path"
        )
    return spec


@torch.no_grad()
def check_packed_forward(model: nn.Module) -> None:
    """Refuse (ValueError naming `model.use_remove_padding`) a model whose backbone gives other
    hidden states on a packed row than on each sequence alone: an architecture whose attention or
    positions ignore the packing would train on sequences that see each other. Checked on three
    short probe rows, two of them with one prompt, packed with that prompt shared where the model's
    attention takes it; tolerance 1e-4 (float32) or 3e-2 (bf16) of the largest hidden value."""
    embeddings = model.get_input_embeddings().weight
    vocab, device = embeddings.shape[0], embeddings.device
    # [prompt | response] per row, left-padded prompts of 3 columns, right-padded responses of 2
    ids = (torch.arange(15, device=device).view(3, 5) * 7919 + 11) % vocab
    ids[1, :3] = ids[0, :3]  # rows 0 and 1 share their prompt
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], device=device)
    backbone = _backbone(model)
    was_training = model.training
    model.eval()
    try:
        alone = torch.zeros(3, 5, embeddings.shape[1], dtype=embeddings.dtype, device=device)
        for i in range(3):
            real = mask[i].bool()
            alone[i, real] = backbone(input_ids=ids[i, real][None], use_cache=False).last_hidden_state[0]
        packed = pack_rows(mask, 2, ids if prompt_sharing(model) else None)
        together = backbone(input_ids=packed.pack(ids), use_cache=False, **packed.backbone_kwargs()).last_hidden_state[0]
        alone = alone.reshape(15, -1).index_select(0, packed.token_index)
    finally:
        model.train(was_training)
    low_precision = embeddings.dtype != torch.float32
    tol = (3e-2 if low_precision else 1e-4) * max(1.0, alone.abs().max().item())
    diff = (alone.float() - together.float()).abs().max().item()
    if not diff <= tol:
        raise ValueError(
            f"{type(model).__name__}: on packed sequences its hidden states differ from those of each sequence alone "
            f"(max difference {diff:.3g}): its attention or position ids do not follow the packing. "
            "Set model.use_remove_padding=false to train it on padded batches"
        )


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def _packing(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, share_prompts: bool
) -> tuple[PackedRows, SequenceParallel | None]:
    """The packed row of a micro-batch, or with sequence parallelism this rank's slice of it, and
    the group (whose `gather` then completes the per-response-token results). `share_prompts`:
    rows with the same prompt hold it once, where the model's attention path takes that."""
    share = share_prompts and prompt_sharing(model)
    packed = pack_rows(attention_mask, response_len, input_ids if share else None)
    sp = sequence_parallel_of(model)
    return (packed, None) if sp is None else (packed.shard(sp.rank, sp.size), sp)


def _packed_forward(module: nn.Module, model: nn.Module, input_ids: torch.Tensor, packed: PackedRows, sp: SequenceParallel | None):
    """`module` (the backbone, or the whole value model) on the packed row or slice, tallied on `model`."""
    kwargs = packed.backbone_kwargs()
    if sp is not None:
        kwargs[SEQUENCE_PARALLEL_KWARG] = sp
    out = module(input_ids=packed.pack(input_ids), use_cache=False, **kwargs)
    token_tally(model).add(packed.tokens, packed.real_tokens + packed.shared_tokens)
    return out


def response_hidden_states(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Hidden states that predict each response token: positions P-1 .. P+R-2, shape [N, R, H]."""
    return _hidden_before_responses(
        model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"].shape[1]
    )


def _hidden_before_responses(model: nn.Module, input_ids, attention_mask, position_ids, response_len: int) -> torch.Tensor:
    out = _backbone(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    token_tally(model).add(input_ids.numel(), attention_mask.sum())
    hidden = out.last_hidden_state
    return hidden[:, -response_len - 1 : -1, :]


def response_log_probs(
    model: nn.Module,
    batch: Batch,
    temperature: float,
    *,
    chunk_tokens: int = 1024,
    compute_entropy: bool = False,
    backend: str = "auto",
    remove_padding: bool = True,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `batch["responses"]` under `model`, both [N, R]
    (0 at padded response positions when `remove_padding`; `share_prompts`: packed rows with the
    same prompt hold it once, `model.share_prompt_prefix`).

    An FSDP-sharded model carries this computation as a registered forward method (see
    `rlcore.workers.fsdp.shard_model`) so its root parameters are gathered around it.
    """
    fn = getattr(model, "rlcore_response_log_probs", None)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"], float(temperature))
    kwargs = dict(chunk_tokens=chunk_tokens, compute_entropy=compute_entropy, backend=backend, remove_padding=remove_padding,
                  share_prompts=share_prompts)
    if fn is not None:
        return fn(*args, **kwargs)
    return forward_response_log_probs(model, *args, **kwargs)


def forward_response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    temperature: float,
    *,
    chunk_tokens: int = 1024,
    compute_entropy: bool = False,
    backend: str = "auto",
    remove_padding: bool = True,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The computation behind `response_log_probs` (what FSDP registers as a forward method).

    Packed (`remove_padding`), the head runs only on the hidden states that predict real response
    tokens. The head's weight and bias are used in the hidden state's dtype and device: under mixed
    precision the backbone computes in bf16 and so does the head (as FSDP2 casts it), and with CPU
    offload the head's master copy lives on the host."""
    n, r = responses.shape
    packed, sp = _packing(model, input_ids, attention_mask, r, share_prompts) if remove_padding else (None, None)
    if packed is not None:
        hidden = packed.predictors(_packed_forward(_backbone(model), model, input_ids, packed, sp).last_hidden_state)
        targets = packed.targets(responses)
    else:
        hidden = _hidden_before_responses(model, input_ids, attention_mask, position_ids, r)
        hidden = hidden.reshape(n * r, hidden.shape[-1])
        targets = responses.reshape(-1)
    spec = lm_head_semantics(model)
    head = model.get_output_embeddings()
    weight = head.weight.to(device=hidden.device, dtype=hidden.dtype)
    bias = head.bias.to(device=hidden.device, dtype=hidden.dtype) if spec.has_bias else None
    out = fused_token_logprobs(
        hidden,
        weight,
        targets,
        bias=bias,
        logit_scale=spec.logit_scale,
        softcap=spec.softcap,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        backend=backend,
    )
    if packed is not None:
        logprobs = packed.scatter(out.logprobs)
        entropy = packed.scatter(out.entropy) if out.entropy is not None else None
        if sp is not None:  # each entry was computed on one rank of the group
            logprobs = sp.gather(logprobs)
            entropy = sp.gather(entropy) if entropy is not None else None
        return logprobs, entropy
    logprobs = out.logprobs.view(n, r)
    entropy = out.entropy.view(n, r) if out.entropy is not None else None
    return logprobs, entropy


def response_values(model: nn.Module, batch: Batch, remove_padding: bool = True, share_prompts: bool = False) -> torch.Tensor:
    """Critic values of the states before each response token, [N, R] float32 (0 at padded
    response positions when `remove_padding`; `share_prompts` as in `response_log_probs`)."""
    response_len = batch["responses"].shape[1]
    if remove_padding:
        packed, sp = _packing(model, batch["input_ids"], batch["attention_mask"], response_len, share_prompts)
        out = _packed_forward(model, model, batch["input_ids"], packed, sp)
        values = packed.scatter(packed.predictors(out.logits).squeeze(-1).float())
        return values if sp is None else sp.gather(values)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    )
    token_tally(model).add(batch["input_ids"].numel(), batch["attention_mask"].sum())
    values = out.logits.squeeze(-1)[:, -response_len - 1 : -1]
    return values.float()


def named_weights_for_sync(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The full state for a rollout engine, tied weights included explicitly.

    A state dict without `lm_head.weight` for a tied model leaves the engine's head stale
    (vLLM keeps the old tensor): always send it.
    """
    state = model.state_dict()
    named = [(k, v.detach()) for k, v in state.items()]
    if "lm_head.weight" not in state and getattr(model.config, "tie_word_embeddings", False):
        named.append(("lm_head.weight", model.get_output_embeddings().weight.detach()))
    return named
