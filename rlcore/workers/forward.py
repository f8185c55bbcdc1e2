"""The forward passes shared by actor, reference, critic and reward model: per-token log-probs,
values, a reward model's sequence scores, and the LM head's semantics they rely on.

Log-probs are computed from the last hidden state and the LM head through
`rlcore.triton_kernels` in token chunks, so the `[tokens, vocab]` float32 logits of a whole
batch never exist at once. With `remove_padding` (config `model.use_remove_padding`, on by default)
the backbone runs on the micro-batch's real tokens packed into one row (`rlcore.workers.packed`)
with packed-sequence attention (`rlcore.workers.attention`), and the head only on the hidden
states that predict real response tokens. The head is applied with the model's own semantics
(bias, logit scale, final soft-cap; `lm_head_semantics`). The reward model (a sequence classifier)
is read the same way: its score head on the hidden state of each sequence's last non-pad token.
That each model computes here what its own forward computes is proven when it is loaded
(`rlcore.workers.model_checks`).

These forwards run parts of the model outside `model.forward` (the backbone, then a head). A
sharded model must gather its root's parameters around them: a worker passes
`POLICY_FORWARD_METHODS` or `SCORE_FORWARD_METHODS` to `rlcore.workers.fsdp.shard_model`, which
registers them on the model under their names, and `response_log_probs` / `sequence_scores` call
the registered method when there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.errors import RLCoreError
from rlcore.protocol import Batch
from rlcore.triton_kernels import fused_token_logprobs
from rlcore.workers.attention import SEQUENCE_PARALLEL_KWARG, prompt_sharing
from rlcore.workers.packed import PackedRows, pack_rows, token_tally
from rlcore.workers.parallel.tensors import vocab_rows
from rlcore.workers.ulysses import SequenceParallel, sequence_parallel_of

LOG_PROBS_METHOD = "rlcore_response_log_probs"  # where a sharded model carries `forward_response_log_probs`
SCORES_METHOD = "rlcore_sequence_scores"  # where a sharded model carries `forward_sequence_scores`


class NotASequenceClassifier(RLCoreError, ValueError):
    """A reward model folder that is not a trained one-label sequence classifier; names the key
    (an input error: the command prints it as one line)."""


@dataclass(frozen=True)
class LMHead:
    """How a causal LM turns its last hidden state h into logits: (h @ W.T + b) * logit_scale,
    then softcap * tanh(. / softcap) when soft-capped."""

    has_bias: bool
    logit_scale: float = 1.0
    softcap: float | None = None


def text_config(model: nn.Module) -> Any:
    """The config of the language model inside `model` (a multimodal model's text config)."""
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
    config = text_config(model)
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


def model_pad_token_id(model: nn.Module) -> int | None:
    """The pad token `model`'s config names (where a sequence classifier reads its score)."""
    pad = text_config(model).pad_token_id
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
    fn = getattr(model, SCORES_METHOD, None)
    if fn is not None:
        return fn(input_ids, attention_mask, remove_padding=remove_padding)
    return forward_sequence_scores(model, input_ids, attention_mask, remove_padding=remove_padding)


def forward_sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                            remove_padding: bool = True) -> torch.Tensor:
    """The computation behind `sequence_scores`: the backbone on the real tokens (packed into one
    row, or the padded batch), the score head only on each sequence's scored hidden state."""
    pad = model_pad_token_id(model)
    lens = attention_mask.sum(-1)
    if remove_padding:
        packed = pack_rows(attention_mask, 0)
        hidden = _packed_forward(backbone(model), model, input_ids, packed, None).last_hidden_state[0]  # no sequence parallelism
        device = input_ids.device
        seq_lens = torch.tensor(packed.seq_lens, dtype=torch.long, device=device)
        scored = last_scored_index(packed.pack(input_ids)[0], packed.cu_seqlens[:-1].long(), seq_lens, pad)
        sequence_of_row = torch.empty_like(scored)  # the packing orders sequences by length, not by row
        sequence_of_row[torch.tensor(packed.sequence_rows, device=device)] = torch.arange(scored.numel(), device=device)
        picked = hidden.index_select(0, scored.index_select(0, sequence_of_row))
    else:
        n, width = input_ids.shape
        out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        token_tally(model).add(input_ids.numel(), lens.sum())
        starts = torch.arange(n, device=input_ids.device) * width
        whole_rows = torch.full_like(lens, width)  # transformers' rule looks at every position of a row
        flat = last_scored_index(input_ids.reshape(-1), starts, whole_rows if pad is not None else lens, pad)
        picked = out.last_hidden_state.reshape(n * width, -1).index_select(0, flat)
    head = score_head(model)
    bias = head.bias.to(picked.dtype) if head.bias is not None else None
    return F.linear(picked, head.weight.to(device=picked.device, dtype=picked.dtype), bias).squeeze(-1).float()


def backbone(model: nn.Module) -> nn.Module:
    """The transformer under the head (transformers' `base_model_prefix`: `model.model`)."""
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
    out = backbone(model)(
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

    An FSDP-sharded model carries this computation as a registered forward method (`POLICY_FORWARD_METHODS`,
    given to `rlcore.workers.fsdp.shard_model`) so its root parameters are gathered around it.
    """
    fn = getattr(model, LOG_PROBS_METHOD, None)
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
        hidden = packed.predictors(_packed_forward(backbone(model), model, input_ids, packed, sp).last_hidden_state)
        targets = packed.targets(responses)
    else:
        hidden = _hidden_before_responses(model, input_ids, attention_mask, position_ids, r)
        hidden = hidden.reshape(n * r, hidden.shape[-1])
        targets = responses.reshape(-1)
    spec = lm_head_semantics(model)
    head = model.get_output_embeddings()
    weight, vocab_shard = vocab_rows(head.weight)  # tensor parallel: this rank's rows of the head
    weight = weight.to(device=hidden.device, dtype=hidden.dtype)
    bias = vocab_rows(head.bias)[0].to(device=hidden.device, dtype=hidden.dtype) if spec.has_bias else None
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
        vocab_shard=vocab_shard,
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


# What a worker passes to `shard_model(..., forward_methods=...)`: attribute name -> computation.
POLICY_FORWARD_METHODS: dict[str, Callable[..., Any]] = {LOG_PROBS_METHOD: forward_response_log_probs}
SCORE_FORWARD_METHODS: dict[str, Callable[..., Any]] = {SCORES_METHOD: forward_sequence_scores}
