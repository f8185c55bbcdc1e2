"""The actor update's efficiency switches change speed, never the step:

- `actor.cast_once`: the bf16 compute copies made once per optimizer step (kept across its
  micro-batches) give, bit for bit, the gradients and weights of copies made for every
  micro-batch, in one process (`LocalPolicy`) and under FSDP2 (a one-rank gloo group here);
- `actor.compile`: which devices and layouts compile ("auto": CUDA only), that nothing compiles
  on CPU by default, and that under "auto" a layer whose compilation fails runs eagerly. Real
  compilation is checked against eager on a GPU (skipped here: compiling costs tens of CPU seconds);
- `actor.liger_kernel`: refused where it cannot run (a CPU device), named in one line; its kernels
  against the plain model on a GPU with liger-kernel installed (skipped here).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.config import Config, ConfigError, config_from_dict, role_spec, set_key
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker
from rlcore.workers.compile import _with_fallback, compile_wanted
from rlcore.workers.fsdp import cast_once_wanted, keeps_compute_copies

VOCAB = 64
P, R, N = 6, 5, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("efficiency") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _config(model_dir: Path, tmp_path: Path, **overrides) -> Config:
    tree: dict = {
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(tmp_path / "unused.parquet")], "train_batch_size": 4},
        # one optimizer step per update (4 prompts x n=2), 3 rows of 11 tokens per micro-batch: 3 micro-batches
        "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": 1e-3}, "max_tokens_per_micro_batch": 33,
                  "mixed_precision": "bf16"},
        "rollout": {"backend": "hf", "n": 2},
        "trainer": {"device": "cpu", "output_dir": str(tmp_path / "run")},
    }
    for dotted, value in overrides.items():
        set_key(tree, dotted.split("__"), value)
    return config_from_dict(tree)


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (N, P), generator=g)
    responses = torch.randint(3, VOCAB, (N, R), generator=g)
    attn = torch.ones(N, P + R, dtype=torch.long)
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn, "position_ids": attn.cumsum(-1) - 1, "response_mask": torch.ones(N, R),
            "old_log_probs": -float(np.log(VOCAB)) + 0.1 * torch.randn(N, R, generator=g),
            "advantages": torch.randn(N, R, generator=g),
        },
        meta={"uid": np.array([str(i) for i in range(N)], dtype=object)},  # distinct prompts: nothing shared
    )


def _two_steps(worker: ActorWorker) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[bool], list[torch.Tensor]]:
    """Two optimizer steps of 3 micro-batches each: each step's gradients, the weights q_proj computed
    with in every forward (kept alive, so identity means reuse), whether layer 0's parameters were
    sharded when each forward reached it (FSDP2), and the weights after."""
    from torch.distributed.tensor import DTensor

    layer = worker.model.model.layers[0]
    q_proj = layer.self_attn.q_proj
    seen: list[torch.Tensor] = []
    sharded: list[bool] = []
    hooks = [q_proj.register_forward_hook(lambda m, args, out: seen.append(m.weight), prepend=True),
             layer.register_forward_pre_hook(lambda m, args: sharded.append(isinstance(q_proj.weight, DTensor)), prepend=True)]
    grads = []
    for seed in (1, 2):
        worker.update_actor(_batch(seed), 2)
        grads.append([p.grad.clone() for p in worker.model.parameters()])
    for hook in hooks:
        hook.remove()
    return grads, seen, sharded, [p.detach().clone() for p in worker.model.parameters()]


def _compare_cast_once(model_dir: Path, tmp_path: Path) -> tuple[list[bool], list[bool], list[torch.Tensor]]:
    """Both settings from the same weights: the same gradients and weights, bit for bit; one compute
    copy per step with cast_once. Returns, per micro-batch forward, whether layer 0 was sharded
    when it started (without and with cast_once) and q_proj's compute weight with it."""
    runs = {}
    for once in (False, True):
        worker = ActorWorker(role_spec(_config(model_dir, tmp_path, actor__cast_once=once), "actor"))
        worker.setup()
        assert keeps_compute_copies(worker.model) is once
        runs[once] = _two_steps(worker)
    (grads_each, seen_each, sharded_each, after_each), (grads_once, seen_once, sharded_once, after_once) = runs[False], runs[True]
    for step_each, step_once in zip(grads_each, grads_once):
        for a, b in zip(step_each, step_once):
            assert a.dtype == torch.float32
            assert torch.equal(a, b)
    for a, b in zip(after_each, after_once):
        assert torch.equal(a, b)
    assert len(seen_each) == len(seen_once) == 6  # 2 steps x 3 micro-batches
    assert all(w.dtype == torch.bfloat16 for w in seen_once)
    assert [len({id(w) for w in seen_once[i:i + 3]}) for i in (0, 3)] == [1, 1]  # one copy per step, for its micro-batches
    return sharded_each, sharded_once, seen_once


def test_cast_once_in_one_process_gives_the_same_step(model_dir, tmp_path):
    assert not (dist.is_available() and dist.is_initialized())
    seen_once = _compare_cast_once(model_dir, tmp_path)[2]
    assert seen_once[0] is not seen_once[3]  # made anew after the step changed the masters
    worker = ActorWorker(role_spec(_config(model_dir, tmp_path, actor__cast_once=False), "actor"))
    worker.setup()
    seen = _two_steps(worker)[1]
    assert len({id(w) for w in seen}) == 6  # without it, a copy per micro-batch


def test_cast_once_under_fsdp2_gives_the_same_step(model_dir, tmp_path):
    """FSDP2 (a one-rank gloo group in this process): the layers stay unsharded from the first
    micro-batch of a step to its end instead of being resharded after each forward and backward;
    resharded before the optimizer step."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from rlcore.workers.fsdp import is_sharded

        worker = ActorWorker(role_spec(_config(model_dir, tmp_path), "actor"))
        worker.setup()
        assert is_sharded(worker.model)
        sharded_each, sharded_once, _ = _compare_cast_once(model_dir, tmp_path)
    finally:
        dist.destroy_process_group()
    assert sharded_each == [True] * 6
    assert sharded_once == [True, False, False] * 2


@pytest.mark.parametrize(("setting", "ranks", "offload", "checkpointing", "local", "want"), [
    ("auto", 1, False, False, True, True),     # one process: the copies live until backward anyway
    ("auto", 1, False, True, True, False),     # gradient checkpointing frees them after each layer's forward
    ("auto", 1, False, False, False, True),    # FSDP2 on one rank
    ("auto", 1, True, False, False, False),    # FSDP2 with CPU offload: the whole model would stay on the GPU
    ("auto", 2, False, False, False, False),   # FSDP2 over ranks: each would hold every parameter
    (True, 8, False, True, False, True),
    (False, 1, False, False, True, False),
])
def test_cast_once_auto(setting, ranks, offload, checkpointing, local, want):
    model = torch.nn.Linear(2, 2)
    model.is_gradient_checkpointing = checkpointing  # what transformers' models report
    assert cast_once_wanted(setting, model, ranks=ranks, cpu_offload=offload, local=local) is want


@pytest.mark.parametrize(("setting", "device", "tp", "liger", "want"), [
    ("auto", "cpu", 1, False, False),
    ("auto", "cuda", 1, False, True),
    ("auto", "cuda", 2, False, False),
    ("auto", "cuda", 1, True, False),
    (True, "cpu", 1, False, True),
    (False, "cuda", 1, False, False),
])
def test_compile_selection(setting, device, tp, liger, want):
    assert compile_wanted(setting, torch.device(device), tensor_parallel=tp, liger=liger) is want


def test_nothing_compiles_on_cpu_by_default(model_dir, tmp_path):
    worker = ActorWorker(role_spec(_config(model_dir, tmp_path), "actor"))
    assert worker.spec.section.compile == "auto"
    worker.setup()
    assert all("forward" not in vars(layer) for layer in worker.model.model.layers)  # the class's own forward


def test_auto_compile_falls_back_to_eager(caplog):
    from torch._dynamo.exc import BackendCompilerFailed

    layer = torch.nn.Linear(3, 2)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise BackendCompilerFailed(lambda *a: None, RuntimeError("inductor said no"), None)

    layer.forward = _with_fallback(layer, failing)
    x = torch.randn(4, 3)
    with caplog.at_level(logging.WARNING, logger="rlcore.workers.compile"):
        out = layer(x)
        layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [1]  # not tried again
    assert "forward" not in vars(layer)  # the eager forward is back
    assert [r.message for r in caplog.records if "actor.compile=auto" in r.message]


def test_liger_kernel_refused_on_cpu(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"actor\.liger_kernel=true needs a CUDA device"):
        _config(model_dir, tmp_path, actor__liger_kernel=True)
    from rlcore.workers.liger import apply_liger_kernels

    with pytest.raises(ValueError, match=r"actor\.liger_kernel=true needs a CUDA device \(the device is cpu\)"):
        apply_liger_kernels(torch.nn.Linear(2, 2), torch.device("cpu"))


def _gpu_actor(model_dir: Path, tmp_path: Path, **overrides) -> ActorWorker:
    worker = ActorWorker(role_spec(_config(model_dir, tmp_path, **{"trainer__device": "cuda", "actor__compile": False, **overrides}), "actor"))
    worker.setup()
    return worker


def _gpu_step(worker: ActorWorker, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logp = worker.compute_log_prob(batch)["old_log_probs"]
    worker.update_actor(batch, 2)
    return logp, [p.grad.float().cpu() for p in worker.model.parameters()]


def _assert_close_step(got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """bf16 compute: the same math through other kernels rounds differently."""
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-2)
    for a, b in zip(got[1], want[1]):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_layers_match_eager_on_gpu(model_dir, tmp_path):
    batch = _batch(3)
    eager = _gpu_step(_gpu_actor(model_dir, tmp_path), batch)
    compiled = _gpu_step(_gpu_actor(model_dir, tmp_path, actor__compile=True), batch)
    _assert_close_step(compiled, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_kernels_match_the_plain_model_on_gpu(model_dir, tmp_path, monkeypatch):
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger swaps them module-wide: put back after
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    batch = _batch(4)
    plain = _gpu_step(_gpu_actor(model_dir, tmp_path), batch)
    liger = _gpu_step(_gpu_actor(model_dir, tmp_path, actor__liger_kernel=True), batch)
    _assert_close_step(liger, plain)
