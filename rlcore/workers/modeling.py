"""Model loading and the per-token forward passes shared by actor, reference and critic.

Log-probs are computed from the last hidden state and the LM head through
`rlcore.triton_kernels` in token chunks, so the `[tokens, vocab]` float32 logits of a whole
batch never exist at once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from rlcore.protocol import Batch
from rlcore.triton_kernels import fused_token_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_causal_lm(path: str | Path, dtype: str, device: torch.device, gradient_checkpointing: bool = False) -> nn.Module:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model.to(device)


def load_value_model(path: str | Path, dtype: str, device: torch.device, gradient_checkpointing: bool = False) -> nn.Module:
    """A causal LM backbone with a scalar head per token (verl's critic: token classification, 1 label)."""
    model = AutoModelForTokenClassification.from_pretrained(
        Path(path), num_labels=1, dtype=_DTYPES[dtype], local_files_only=True
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device)


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `batch["responses"]` under `model`, both [N, R].

    An FSDP-sharded model carries this computation as a registered forward method (see
    `rlcore.workers.fsdp.shard_model`) so its root parameters are gathered around it.
    """
    fn = getattr(model, "rlcore_response_log_probs", None)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"], float(temperature))
    kwargs = dict(chunk_tokens=chunk_tokens, compute_entropy=compute_entropy, backend=backend)
    if fn is not None:
        return fn(*args, **kwargs)
    return _response_log_probs_impl(model, *args, **kwargs)


def _response_log_probs_impl(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = _hidden_before_responses(model, input_ids, attention_mask, position_ids, responses.shape[1])
    n, r, h = hidden.shape
    weight = model.get_output_embeddings().weight
    out = fused_token_logprobs(
        hidden.reshape(n * r, h),
        weight,
        responses.reshape(-1),
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        backend=backend,
    )
    logprobs = out.logprobs.view(n, r)
    entropy = out.entropy.view(n, r) if out.entropy is not None else None
    return logprobs, entropy


def response_values(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Critic values of the states before each response token, [N, R] float32."""
    response_len = batch["responses"].shape[1]
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    )
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
