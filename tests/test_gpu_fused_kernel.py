"""The Triton fused log-prob/entropy kernels on CUDA in bf16, against the torch paths (plain
heads and heads with a bias, logit scale and final soft-cap).

Tolerances (bf16 inputs, fp32 accumulation everywhere):
- log-prob, entropy: 1e-4 absolute. Products of bf16 values are exact in fp32, so the
  paths differ only in fp32 summation order (tile order, tensor-core accumulation).
- gradients: 2e-2 of the largest reference entry. The Triton backward rounds grad_logits to
  bf16 before its tensor-core matmuls, as any bf16 backward does; the torch paths keep them
  in fp32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VALUE_ATOL = 1e-4
GRAD_REL = 2e-2


def _inputs(n, h, v, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "hidden": torch.randn(n, h, generator=g, device="cuda").to(dtype),
        "weight": (torch.randn(v, h, generator=g, device="cuda") * (2.0 / h**0.5)).to(dtype),
        "targets": torch.randint(0, v, (n,), generator=g, device="cuda"),
        "bias": torch.randn(v, generator=g, device="cuda").to(dtype),
        "g_lp": torch.randn(n, generator=g, device="cuda"),
        "g_ent": torch.randn(n, generator=g, device="cuda"),
    }


def _run(x, fn):
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = x["weight"].clone().requires_grad_(True)
    out = fn(hidden, weight)
    loss = (out.logprobs * x["g_lp"]).sum() + (out.entropy * x["g_ent"]).sum()
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    return out.logprobs.detach(), out.entropy.detach(), gh.float(), gw.float()


def _head(x, head):
    """head: "plain", "bias", or "capped" (bias, logit scale 0.5 and soft-cap 10: Gemma 2-like)."""
    return {"plain": {}, "bias": dict(bias=x["bias"]),
            "capped": dict(bias=x["bias"], logit_scale=0.5, softcap=10.0)}[head]


def _fused(x, backend, temperature=1.0, head="plain"):
    from rlcore.triton_kernels import fused_token_logprobs

    return lambda h, w: fused_token_logprobs(h, w, x["targets"], temperature=temperature, backend=backend,
                                             chunk_tokens=256, **_head(x, head))


def _naive(x, temperature=1.0, head="plain"):
    from rlcore.triton_kernels import naive_token_logprobs

    return lambda h, w: naive_token_logprobs(h, w, x["targets"], temperature=temperature, **_head(x, head))


def _assert_close(got, ref):
    for name, a, b in zip(("logprob", "entropy"), got[:2], ref[:2]):
        err = (a - b).abs().max().item()
        assert err <= VALUE_ATOL, f"{name}: max abs err {err:.3g} > {VALUE_ATOL}"
    for name, a, b in zip(("grad_hidden", "grad_weight"), got[2:], ref[2:]):
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= GRAD_REL * scale, f"{name}: max abs err {err:.3g} > {GRAD_REL} x {scale:.3g}"


@pytest.mark.parametrize(
    "n,h,v,temperature,head",
    [
        (1000, 200, 5003, 0.8, "capped"),  # no dimension a multiple of the 64 tiles: every mask used
        (64, 64, 128, 1.0, "plain"),  # exactly one tile in tokens and hidden
        (7, 896, 4096, 1.3, "bias"),  # fewer tokens than one tile
    ],
)
def test_triton_matches_chunked_torch_bf16(n, h, v, temperature, head):
    x = _inputs(n, h, v)
    got = _run(x, _fused(x, "triton", temperature, head))
    ref = _run(x, _fused(x, "torch", temperature, head))
    _assert_close(got, ref)


def test_triton_matches_naive_log_softmax_at_qwen_vocab():
    """Qwen2.5-0.5B's head: hidden 896, vocab 151936; the fp32 log_softmax is the reference."""
    x = _inputs(2048, 896, 151936, seed=1)
    _assert_close(_run(x, _fused(x, "triton")), _run(x, _naive(x)))


def test_triton_is_deterministic():
    """Each program owns the rows it writes (no atomics): two runs agree bit for bit."""
    x = _inputs(777, 256, 3001, seed=2)
    a = _run(x, _fused(x, "triton"))
    b = _run(x, _fused(x, "triton"))
    for t1, t2 in zip(a, b):
        assert torch.equal(t1, t2)


def test_auto_backend_is_triton_on_cuda_and_model_log_probs_agree():
    """`actor.fused_kernels=true` means backend "auto": Triton on CUDA, same numbers as torch."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcore.protocol import Batch
    from rlcore.triton_kernels import resolve_backend
    from rlcore.workers.forward import response_log_probs

    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(3)
    prompts, responses = torch.randint(0, 1000, (4, 6), generator=g), torch.randint(0, 1000, (4, 5), generator=g)
    attn = torch.ones(4, 11, dtype=torch.long)
    attn[0, :2] = 0  # one left-padded prompt
    batch = Batch(tensors={"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn,
                           "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "responses": responses}).to("cuda")
    with torch.no_grad():
        lp_auto, ent_auto = response_log_probs(model, batch, 0.9, compute_entropy=True, backend="auto")
        lp_torch, ent_torch = response_log_probs(model, batch, 0.9, compute_entropy=True, backend="torch")
    assert (lp_auto - lp_torch).abs().max().item() <= VALUE_ATOL
    assert (ent_auto - ent_torch).abs().max().item() <= VALUE_ATOL
