"""Which kernel runs a packed row (`rlcore.workers.attention.packed_attention_path`), for each
device, dtype and installed package; and, on a GPU, that torch's fused `varlen_attn` gives the
per-sequence loop's outputs and gradients (grouped-query heads included).

The selection is plain logic and runs here; the equality tests are marked `gpu` and skip
without CUDA (they have not yet run on a GPU: see README, "Packed attention")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlcore.workers.attention import packed_attention_path, path_for, varlen_attention

HOPPER, AMPERE, TURING = (9, 0), (8, 0), (7, 5)


@pytest.mark.parametrize(("device", "dtype", "flash_attn", "torch_varlen", "capability", "path"), [
    ("cpu", torch.bfloat16, True, True, None, "sdpa_per_length"),  # no fused kernel on a CPU
    ("cpu", torch.float32, False, False, None, "sdpa_per_length"),
    ("cuda", torch.float32, True, True, HOPPER, "sdpa_per_length"),  # Flash kernels take 16-bit floats only
    ("cuda", torch.bfloat16, True, True, HOPPER, "flash_attn"),  # the package, where installed
    ("cuda", torch.float16, True, False, TURING, "flash_attn"),
    ("cuda", torch.bfloat16, False, True, HOPPER, "torch_varlen"),  # torch's own, no package needed
    ("cuda", torch.float16, False, True, AMPERE, "torch_varlen"),
    ("cuda", torch.bfloat16, False, True, TURING, "sdpa_per_length"),  # torch's Flash kernels need sm80+
    ("cuda", torch.bfloat16, False, False, HOPPER, "sdpa_per_length"),  # a torch without varlen_attn
])
def test_the_path_for_each_device_dtype_and_package(device, dtype, flash_attn, torch_varlen, capability, path):
    assert packed_attention_path(device, dtype, flash_attn=flash_attn, torch_varlen=torch_varlen,
                                 capability=capability) == path


def test_a_cpu_tensor_takes_the_per_length_loop_which_shares_prompts():
    assert path_for(torch.zeros(1, dtype=torch.bfloat16)) == "sdpa_per_length"


def test_prompt_sharing_is_judged_at_the_compute_dtype(monkeypatch):
    """Float32 masters computing in bf16 (actor.mixed_precision=bf16) take the bf16 kernel: on a GPU
    whose bf16 path is fused, rows must not share prompts although the weights are float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import rlcore.workers.attention as attention
    from rlcore.workers.fsdp import shard_model

    model = attention.use_packed_attention(LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)))
    assert attention.prompt_sharing(model)  # float32 on a CPU
    as_on_a_gpu = {torch.bfloat16: "torch_varlen", torch.float16: "torch_varlen"}  # what an H200 without flash-attn picks
    monkeypatch.setattr(attention, "path_for", lambda t, dtype=None: as_on_a_gpu.get(dtype or t.dtype, "sdpa_per_length"))
    assert attention.prompt_sharing(model)  # float32 compute: the per-length loop, prompts shared
    shard_model(model, torch.device("cpu"), mixed_precision="bf16")
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert not attention.prompt_sharing(model)


def _per_sequence(q, k, v, lengths):
    """The reference: causal SDPA on each sequence alone, `[1, H, T, D]` in, `[1, T, H, D]` out."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o.transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (8, 8)])
def test_torch_varlen_equals_the_per_sequence_loop_forward_and_backward(heads, kv_heads):
    torch.manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 300, (64,))]
    total, dim = sum(lengths), 64
    qkv = [torch.randn(1, h, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for h in (heads, kv_heads, kv_heads)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    assert path_for(qkv[0]) in ("torch_varlen", "flash_attn")
    fused = varlen_attention(*qkv, cu, max(lengths), scale=None)
    want = _per_sequence(*qkv, lengths)
    torch.testing.assert_close(fused.float(), want.float(), atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(fused, qkv, grad)
    want_grads = torch.autograd.grad(want, qkv, grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        rel = (g.float() - w.float()).norm() / w.float().norm()
        assert rel < 2e-2, rel
