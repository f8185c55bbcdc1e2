"""Model FLOPs of a decoder-only transformer, device peaks, and MFU: the one place these live.

Counted per multiply-add as 2 FLOPs (the convention of PaLM's MFU, Megatron and verl):

    forward  = 2 * body_params * tokens            matmuls of every layer, for each token
             + 2 * head_params * head_tokens       LM head, where logits are needed (response tokens)
             + 4 * layers * attn_width * pairs     scores (QK^T) and weighted sum (AV)
    training = 3 * forward                         backward: 2x the forward

`pairs` are the query-key pairs under the causal mask, s(s+1)/2 for a sequence of s tokens (PaLM
and verl count s^2, the full score matrix; flash attention computes only the causal half, and
model FLOPs count what the model needs). `attn_width` = query heads x head dim. Embedding lookups
are not FLOPs. MFU = model FLOPs / seconds / (devices x peak FLOP/s of one device).

Peaks are dense bf16 tensor-core numbers from NVIDIA's spec sheets (SXM parts where there are
two), found by the device name; anything else (CPUs included) has none unless configured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# substring of torch.cuda.get_device_name() / NVML's name -> dense bf16 FLOP/s (longest match wins)
PEAK_BF16_FLOPS: dict[str, float] = {
    "B200": 2.25e15,
    "B100": 1.75e15,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 6000 Ada": 364e12,
}


def peak_flops_for(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named `device_name` ("NVIDIA H100 80GB HBM3"), or None."""
    hits = [key for key in PEAK_BF16_FLOPS if key.lower() in device_name.lower()]
    return PEAK_BF16_FLOPS[max(hits, key=len)] if hits else None


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs of a decoder-only model depend on (see the module docstring)."""

    body_params: int  # weights of the matmuls every token goes through (attention and MLP projections)
    head_params: int  # the LM head's weight (vocab x hidden); a value head's is ~0
    layers: int
    attn_width: int   # query heads x head dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], head: str = "lm") -> ModelFlops:
        """From a Hugging Face config.json (Llama, Qwen2, Mistral, Gemma, ... with gated MLPs):
        q/o projections (hidden x heads*head_dim), k/v (hidden x kv_heads*head_dim), three MLP
        matrices (hidden x intermediate). `head`: "lm" (vocab x hidden) or "value" (hidden x 1)."""
        cfg = config.get("text_config", config)
        hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * int(cfg["intermediate_size"])
        head_params = int(cfg["vocab_size"]) * hidden if head == "lm" else hidden
        return cls(body_params=layers * per_layer, head_params=head_params, layers=layers, attn_width=heads * head_dim)

    @classmethod
    def from_model_dir(cls, path: str | Path, head: str = "lm") -> ModelFlops:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), head)

    def forward(self, tokens: float, head_tokens: float, pairs: float) -> float:
        """FLOPs of one forward pass over `tokens` tokens with `pairs` causal attention pairs."""
        return 2.0 * self.body_params * tokens + 2.0 * self.head_params * head_tokens + 4.0 * self.layers * self.attn_width * pairs

    def training(self, tokens: float, head_tokens: float, pairs: float) -> float:
        """Forward and backward (twice the forward)."""
        return 3.0 * self.forward(tokens, head_tokens, pairs)


def causal_pairs(lengths: Sequence[int] | Sequence[float]) -> float:
    """Query-key pairs under the causal mask of sequences of these lengths: sum of s(s+1)/2."""
    return float(sum(s * (s + 1) / 2 for s in lengths))


def decode_pairs(prompt_lengths: Sequence[int] | Sequence[float], response_lengths: Sequence[int] | Sequence[float]) -> float:
    """Attention pairs of generating each response after its prompt's cached keys: the j-th new
    token (1-based) attends to prompt + j keys, so r*p + r(r+1)/2 per sample."""
    return float(sum(r * p + r * (r + 1) / 2 for p, r in zip(prompt_lengths, response_lengths)))


def mfu(flops: float, seconds: float, peak_flops: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation, or None without a peak (or a time)."""
    if not peak_flops or seconds <= 0:
        return None
    return flops / seconds / (peak_flops * devices)


__all__ = ["PEAK_BF16_FLOPS", "ModelFlops", "causal_pairs", "decode_pairs", "mfu", "peak_flops_for"]
