"""Proofs, run when a model is loaded, that rlcore's forwards (`rlcore.workers.forward`) compute
what the model's own forward computes: its LM head (`check_lm_head`), packed sequences
(`check_packed_forward`) and a reward model's score (`check_sequence_scores`). A model on which
one differs is refused with an error naming the model class or the config key, before it trains
on numbers it does not define.
"""

from __future__ import annotations

import torch
from torch import nn

from rlcore.workers.attention import prompt_sharing
from rlcore.workers.forward import (
    LMHead,
    NotASequenceClassifier,
    backbone,
    forward_sequence_scores,
    head_logits,
    lm_head_semantics,
    model_pad_token_id,
)
from rlcore.workers.packed import pack_rows, token_tally


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
        hidden = backbone(model)(input_ids=ids, use_cache=False).last_hidden_state
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
    body = backbone(model)
    was_training = model.training
    model.eval()
    try:
        alone = torch.zeros(3, 5, embeddings.shape[1], dtype=embeddings.dtype, device=device)
        for i in range(3):
            real = mask[i].bool()
            alone[i, real] = body(input_ids=ids[i, real][None], use_cache=False).last_hidden_state[0]
        packed = pack_rows(mask, 2, ids if prompt_sharing(model) else None)
        together = body(input_ids=packed.pack(ids), use_cache=False, **packed.backbone_kwargs()).last_hidden_state[0]
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


@torch.no_grad()
def check_sequence_scores(model: nn.Module, *, key: str, lengths: tuple[int, ...] = (5, 3)) -> None:
    """Refuse (ValueError naming `key`) a sequence classifier whose own forward scores two
    right-padded probe sequences otherwise than `sequence_scores` reads them (packed and padded):
    the scores rlcore trains with and rewards by must be the ones `from_pretrained` users get.
    Tolerance: 1e-4 (float32) or 3e-2 (bf16) of the largest score."""
    embeddings = model.get_input_embeddings().weight
    vocab, device = embeddings.shape[0], embeddings.device
    pad = model_pad_token_id(model)
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
    if not torch.isfinite(own).all():
        raise NotASequenceClassifier(
            f"{key}: {type(model).__name__} scores two probe sequences as {own.tolist()}: its forward overflows (a "
            "score head or layer with huge weights, or non-finite ones); not a usable reward model")
    low_precision = embeddings.dtype != torch.float32
    tol = (3e-2 if low_precision else 1e-4) * max(1.0, own.abs().max().item())
    diff = max((own - o).abs().max().item() for o in ours)
    if not diff <= tol:
        raise ValueError(
            f"{key}: {type(model).__name__}'s forward scores differently from rlcore's reading of a reward model "
            f"(the score head on the last non-pad token; max difference {diff:.3g} on two probe sequences): "
            "this architecture is not supported as a reward model")
