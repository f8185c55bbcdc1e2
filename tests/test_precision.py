"""Precision settings do what they say, in one process on CPU (no process group):

- `actor.mixed_precision: bf16` computes in bf16 over float32 master weights, gradients and AdamW
  state (before, it was silently ignored without a process group);
- `model.dtype: bfloat16` trains float32 masters (actor and critic) and computes in bf16, exactly as
  the bf16 reference model does, unless `model.pure_bf16` asks for bf16 weights and AdamW state;
- `actor.cpu_offload` is refused where it cannot mean anything (a CPU device), and on CUDA keeps
  the masters in host memory (GPU test, skipped without CUDA).

"Computes in bf16" is checked by value, not by flag: log-probs equal, bit for bit, those of a copy
of the weights with only the parameters cast to bf16 (buffers such as RoPE's inv_freq stay float32,
as in FSDP2's MixedPrecisionPolicy), and differ from the float32 model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.config import Config, ConfigError, config_from_dict, role_spec, set_key
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.forward import response_log_probs, response_values
from rlcore.workers.fsdp import shard_model

VOCAB = 64
P, R, N = 6, 5, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny float32 Llama checkpoint (untied head, so every parameter has one gradient path)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("precision") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _config(model_dir: Path, tmp_path: Path, **overrides) -> Config:
    tree: dict = {
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(tmp_path / "unused.parquet")], "train_batch_size": 4},
        "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": 1e-3}},
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
            "returns": torch.randn(N, R, generator=g), "values": 0.1 * torch.randn(N, R, generator=g),
        },
        meta={"uid": np.array([str(i // 2) for i in range(N)], dtype=object)},
    )


def _plain_copy(model: torch.nn.Module, param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The same weights in a fresh module of the same class (no precision hooks, which a deepcopy
    would carry over), parameters (not buffers) in `param_dtype`: with bf16, what FSDP2's bf16
    policy computes with."""
    plain = type(model)(model.config)
    plain.load_state_dict(model.state_dict())
    for p in plain.parameters():
        p.data = p.data.to(param_dtype)
    return plain.eval()


def _adam_state_dtypes(optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    return {v.dtype for state in optimizer.state.values() for k, v in state.items() if k != "step"}


def _log_probs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(model, batch, 1.0, backend="torch")[0]


def test_actor_mixed_precision_bf16_without_process_group(model_dir, tmp_path):
    assert not (dist.is_available() and dist.is_initialized())
    worker = ActorWorker(role_spec(_config(model_dir, tmp_path, actor__mixed_precision="bf16"), "actor"))
    worker.setup()
    batch = _batch()
    master = _plain_copy(worker.model)  # float32 weights before the update

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    q_proj = worker.model.model.layers[0].self_attn.q_proj
    # prepend: run before the policy's own hook puts the float32 master back
    handle = q_proj.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)), prepend=True)
    before = worker.compute_log_prob(batch)["old_log_probs"]
    metrics = worker.update_actor(batch, 2)
    handle.remove()

    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}  # every forward computed in bf16
    torch.testing.assert_close(before, _log_probs(_plain_copy(master, torch.bfloat16), batch), rtol=0, atol=0)
    assert (before - _log_probs(master, batch)).abs().max().item() > 1e-4  # not the float32 numbers
    assert metrics["actor/bad_updates"] == 0.0
    params = list(worker.model.named_parameters())
    assert {p.dtype for _, p in params} == {torch.float32}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for _, p in params)
    assert _adam_state_dtypes(worker.optimizer) == {torch.float32}
    assert [n for n, _ in params] == [n for n, _ in master.named_parameters()]  # checkpoint/sync names unchanged
    moved = max((p.detach() - q.detach()).abs().max().item() for (_, p), q in zip(params, master.parameters()))
    assert moved > 1e-4  # the masters were updated


def test_mixed_precision_gradients_are_bf16_compute_accumulated_in_fp32(model_dir):
    """Two micro-batches: each gradient is the bf16-compute gradient, summed in float32 on the
    master (exact for one micro-batch; bf16 accumulation would round the sum)."""
    from rlcore.workers.loading import load_causal_lm

    model = shard_model(load_causal_lm(model_dir, "float32", torch.device("cpu")), torch.device("cpu"), "bf16")
    reference = _plain_copy(model, torch.bfloat16)
    grads_ref = []
    for seed in (1, 2):
        batch = _batch(seed)
        lp, ent = response_log_probs(model, batch, 0.8, compute_entropy=True, backend="torch")
        (lp.sum() + ent.sum()).backward()
        lp_ref, ent_ref = response_log_probs(reference, batch, 0.8, compute_entropy=True, backend="torch")
        torch.testing.assert_close(lp, lp_ref, rtol=0, atol=0)
        grads_ref.append(torch.autograd.grad(lp_ref.sum() + ent_ref.sum(), list(reference.parameters())))
    for p, g1, g2 in zip(model.parameters(), *grads_ref):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, g1.float() + g2.float(), rtol=0, atol=0)


def test_mixed_precision_with_gradient_checkpointing(model_dir):
    """Recomputed layers are cast again (the hooks run in the recompute): same gradients."""
    from rlcore.workers.loading import load_causal_lm

    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(model_dir, "float32", torch.device("cpu"), gradient_checkpointing=checkpointing)
        model = shard_model(model, torch.device("cpu"), "bf16").train()
        lp, _ = response_log_probs(model, _batch(3), 1.0, backend="torch")
        lp.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("pure", [False, True])
def test_model_dtype_bfloat16_masters_unless_pure_bf16(model_dir, tmp_path, pure):
    """bf16 training keeps float32 masters (an lr-1e-5 step moves nearly every weight); pure bf16
    trains the bf16 weights, where most such steps are below bf16's resolution and are lost."""
    cfg = _config(model_dir, tmp_path, model__dtype="bfloat16", model__pure_bf16=pure, actor__optim__lr=1e-5)
    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    ref = ReferenceWorker(role_spec(cfg, "ref"))
    ref.setup()
    batch = _batch()
    start = {n: p.detach().clone() for n, p in worker.model.named_parameters()}

    # step 0: the actor computes exactly what the bf16 reference model computes
    actor_lp = worker.compute_log_prob(batch)["old_log_probs"]
    ref_lp = ref.compute_ref_log_prob(batch)["ref_log_probs"]
    torch.testing.assert_close(actor_lp, ref_lp, rtol=0, atol=0)
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}

    worker.update_actor(batch, 2)
    want = torch.bfloat16 if pure else torch.float32
    params = dict(worker.model.named_parameters())
    assert {p.dtype for p in params.values()} == {want}
    assert {p.grad.dtype for p in params.values()} == {want}
    assert _adam_state_dtypes(worker.optimizer) == {want}
    changed = sum(int((p.detach() != start[n]).sum()) for n, p in params.items()) / sum(p.numel() for p in params.values())
    if pure:
        assert changed < 0.5, changed
    else:
        assert changed > 0.9, changed


def test_critic_follows_model_dtype(model_dir, tmp_path):
    cfg = _config(model_dir, tmp_path, model__dtype="bfloat16", algorithm__name="ppo", algorithm__adv_estimator="gae")
    critic = CriticWorker(role_spec(cfg, "critic"))
    critic.setup()
    batch = _batch()
    with torch.no_grad():
        values = response_values(critic.model, batch)
        want = response_values(_plain_copy(critic.model, torch.bfloat16), batch)
    torch.testing.assert_close(values, want, rtol=0, atol=0)
    critic.update_critic(batch, 2)
    params = list(critic.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params} == {torch.float32}
    assert _adam_state_dtypes(critic.optimizer) == {torch.float32}


def test_settings_that_cannot_apply_are_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="actor.cpu_offload"):
        _config(model_dir, tmp_path, actor__cpu_offload=True)  # trainer.device=cpu
    with pytest.raises(ConfigError, match="model.pure_bf16"):
        _config(model_dir, tmp_path, model__pure_bf16=True)  # model.dtype float32
    # trainer.device=auto that resolves to the CPU: refused when the actor shards its model
    with pytest.raises(ValueError, match="actor.cpu_offload"):
        shard_model(torch.nn.Linear(2, 2), torch.device("cpu"), cpu_offload=True)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        shard_model(torch.nn.Linear(2, 2), torch.device("cpu"), "fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_on_one_gpu_keeps_masters_on_host(model_dir, tmp_path):
    """Offloaded (masters, gradients and AdamW state on the host, AdamW stepped there) and plain
    bf16 mixed precision on the GPU take the same update."""
    results = []
    for offload in (False, True):
        cfg = _config(model_dir, tmp_path, trainer__device="cuda", actor__mixed_precision="bf16",
                      actor__cpu_offload=offload)
        worker = ActorWorker(role_spec(cfg, "actor"))
        worker.setup()
        worker.update_actor(_batch(), 2)
        params = list(worker.model.parameters())
        where = {p.device.type for p in params} | {p.grad.device.type for p in params}
        where |= {v.device.type for s in worker.optimizer.state.values() for k, v in s.items() if k != "step"}
        assert where == ({"cpu"} if offload else {"cuda"})
        assert {p.dtype for p in params} == {torch.float32}
        results.append([p.detach().cpu() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
