"""Triton kernels under TRITON_INTERPRET=1 against the chunked torch path, forward and backward,
for plain heads and heads with a bias, a logit scale and a final soft-cap.

``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, i.e. when
rlcore.triton_kernels.triton_impl is first imported. Setting it inside the pytest process could
also flip other triton users, so this file re-runs itself as a subprocess with the variable set
(see ``__main__`` below): the child computes the triton results on shared inputs, the parent
compares them with the torch path. Shapes are small on purpose (the interpreter is ~1000x slower).

Tolerances: fp32 1e-5 on values and 1e-5 relative to the largest gradient entry. bf16 values
1e-5 (fp32 accumulation on both sides); bf16 gradients 2e-2 relative, because the kernels round
grad_logits to bf16 before the tensor-core matmul, as a GPU bf16 backward would, while the
torch path keeps them in fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

# name -> (N, H, V, dtype, temperature, block sizes or None for the kernel defaults, head)
# head: (bias, logit_scale, softcap), as in tests/test_fused_logprob.py
PLAIN = (False, 1.0, None)
CASES = {
    "fp32_defaults": (19, 40, 100, torch.float32, 0.7, None, PLAIN),
    "fp32_small_blocks": (37, 40, 100, torch.float32, 1.3, (16, 32, 16), PLAIN),
    "fp32_single_token": (1, 32, 96, torch.float32, 1.0, (16, 32, 16), PLAIN),
    "bf16_small_blocks": (37, 40, 100, torch.bfloat16, 0.9, (16, 32, 16), PLAIN),
    "fp32_zero_tokens": (0, 32, 96, torch.float32, 1.0, None, (True, 1.0, None)),
    "fp32_bias": (37, 40, 100, torch.float32, 0.8, (16, 32, 16), (True, 1.0, None)),
    "fp32_scale": (19, 40, 100, torch.float32, 1.0, (16, 32, 16), (False, 0.0625, None)),
    "fp32_softcap": (37, 40, 100, torch.float32, 0.7, (16, 32, 16), (False, 1.0, 3.0)),
    "bf16_all": (37, 40, 100, torch.bfloat16, 0.9, (16, 32, 16), (True, 2.5, 4.0)),
}


def _case_inputs(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(n, h, generator=g).to(dtype),
        "weight": (0.5 * torch.randn(v, h, generator=g)).to(dtype),
        "bias": (2.0 * torch.randn(v, generator=g)).to(dtype),
        "targets": torch.randint(0, v, (n,), generator=g),
        "g_lp": torch.randn(n, generator=g),
        "g_ent": torch.randn(n, generator=g),
    }


def _run_case(x, temperature, blocks, head, backend_fn):
    """[logprobs, entropy, grad_hidden, grad_weight, grad_bias or None] for one implementation."""
    with_bias, scale, cap = head
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = x["weight"].clone().requires_grad_(True)
    bias = x["bias"].clone().requires_grad_(True) if with_bias else None
    kw = dict(temperature=temperature, bias=bias, logit_scale=scale, softcap=cap)
    out = backend_fn(hidden, weight, x["targets"], kw, blocks)
    loss = (out.logprobs * x["g_lp"]).sum() + (out.entropy * x["g_ent"]).sum()
    grads = torch.autograd.grad(loss, [hidden, weight] + ([bias] if with_bias else []))
    return [out.logprobs.detach(), out.entropy.detach(), *grads] + ([] if with_bias else [None])


def _triton_fn(hidden, weight, targets, kw, blocks):
    from rlcore.triton_kernels import fused_token_logprobs, triton_impl

    defaults = triton_impl.BLOCK_N, triton_impl.BLOCK_V, triton_impl.BLOCK_H
    if blocks is not None:
        triton_impl.BLOCK_N, triton_impl.BLOCK_V, triton_impl.BLOCK_H = blocks
    try:
        return fused_token_logprobs(hidden, weight, targets, backend="triton", **kw)
    finally:
        triton_impl.BLOCK_N, triton_impl.BLOCK_V, triton_impl.BLOCK_H = defaults


def _torch_fn(hidden, weight, targets, kw, blocks):
    from rlcore.triton_kernels import fused_token_logprobs

    return fused_token_logprobs(hidden, weight, targets, chunk_tokens=8, chunk_vocab=48, backend="torch", **kw)


def _child(path: str) -> None:
    """Subprocess body: TRITON_INTERPRET=1 is already in the environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name, (n, h, v, dtype, temperature, blocks, head) in CASES.items():
        x = _case_inputs(n, h, v, dtype)
        results[name] = _run_case(x, temperature, blocks, head, _triton_fn)
    torch.save(results, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


def _assert_rel(actual, expected, rtol, what):
    assert actual.shape == expected.shape, what
    if expected.numel() == 0:
        return
    scale = expected.float().abs().max().clamp_min(1.0)
    err = (actual.float() - expected.float()).abs().max()
    assert err <= rtol * scale, f"{what}: max abs err {err:.3g} > {rtol} * {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter_matches_torch_path(name, triton_results):
    n, h, v, dtype, temperature, blocks, head = CASES[name]
    x = _case_inputs(n, h, v, dtype)
    want = _run_case(x, temperature, blocks, head, _torch_fn)
    got = triton_results[name]
    for label, a, b in zip(("logprobs", "entropy"), got[:2], want[:2]):
        assert a.dtype == torch.float32 and a.shape == (n,)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {label}")
    grad_rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for label, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), got[2:], want[2:]):
        if b is None:
            assert a is None, f"{name} {label}"
            continue
        assert a.dtype == dtype
        _assert_rel(a, b, grad_rtol, f"{name} {label}")


if __name__ == "__main__":
    _child(sys.argv[1])
