"""Tensor parallelism (DTensor) through the real workers, against one process.

Gloo processes run the actor (policy loss with entropy and KL), the critic (value loss) and the
reward model (Bradley-Terry) on a Llama (multi-head, untied head) and a Qwen2 with grouped-query
attention and tied embeddings, at FSDP x TP = 2 x 2 and TP + Ulysses (2 x 2, one data-parallel
shard) (four processes: every role on both models), and at tensor-parallel size 2 alone (two
processes: the cases the four-process launch lacks). Each role's no-grad forward
(log-probs and entropy, values, scores), its update's metrics (loss, KL, entropy, gradient norm,
token counts), the full gradients of the last step and the updated weights equal one process's.
Calls are dispatched and collected as a worker group does (`gloo_ranks.call`), with several
micro-batches and two optimizer steps per update (one for the reward model). Tolerances: float32 sums in another order
(1e-5 on per-token values; gradients 1e-4 of each parameter's largest entry; weights 1e-5, except
where the gradient is float32 noise, which AdamW's m / sqrt(v) turns into steps of up to lr).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from gloo_ranks import call, launch  # tests/ is on sys.path
from test_reward_model_lora import _backbone, _pairs
from tiny_models import ARCHS, VOCAB, assert_grads_close

from rlcore.config import Config, config_from_dict, role_spec
from rlcore.data.preference import sequence_tensors
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.fsdp import to_full
from rlcore.workers.reward_model import RewardModelWorker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LR = 1e-3


def save_models(root: Path) -> Path:
    """Policy folders of each architecture, and reward-model backbones with a chat template."""
    for arch in ("llama", "qwen2-gqa"):
        config, lm, _ = ARCHS[arch]
        torch.manual_seed(0)
        lm(config).save_pretrained(root / arch)
        _backbone(root / f"rm-{arch}", arch.split("-")[0])
    return root


def role_config(root: Path, role: str, arch: str, layout: dict | None, device: str = "cpu") -> Config:
    """A run config whose `role` has `layout` (None: one process)."""
    tree: dict = {"model": {"path": str(root / arch)}, "data": {"train_files": ["unused.parquet"], "train_batch_size": 4},
                  "trainer": {"device": device, "backend": "ray" if layout else "inprocess", "seed": 3},
                  "actor": {"ppo_mini_batch_size": 2, "weight_sync_bucket_mb": 0.01, "max_tokens_per_micro_batch": 24, "use_kl_loss": True,
                            "entropy_coeff": 0.01, "logprob_chunk_tokens": 5, "optim": {"lr": LR}},
                  "rollout": {"n": 2}, "critic": {"optim": {"lr": LR}}}
    if role == "critic":
        tree["algorithm"] = {"name": "ppo", "adv_estimator": "gae"}
    if role == "reward_model":
        tree["algorithm"] = {"name": "rm"}
        tree["model"]["path"] = str(root / f"rm-{arch}")
        # one optimizer step on the 4 pairs: data-parallel ranks each take a contiguous half of them,
        # so two steps would group the pairs into steps otherwise than one process does
        tree["reward_model"] = {"optim": {"lr": LR}, "mini_batch_size": 4, "max_tokens_per_micro_batch": 64}
    if layout:
        tree[role]["layout"] = layout
    return config_from_dict(tree)


SAMPLES_PER_PROMPT = 2  # rl_batch's rows per prompt (rollout.n of role_config)


def rl_batch() -> Batch:
    """Eight rows (4 prompts x 2) of varied lengths, with what the actor and critic updates read."""
    g = torch.Generator().manual_seed(3)
    lens = [(9, 8), (3, 2), (6, 5), (2, 7), (7, 1), (4, 6), (5, 3), (8, 4)]
    t = sequence_tensors([torch.randint(1, VOCAB, (p,), generator=g).tolist() for p, _ in lens],
                         [torch.randint(1, VOCAB, (r,), generator=g).tolist() for _, r in lens], pad_id=0)
    n, r = t["responses"].shape
    t.update(advantages=torch.randn(n, 1, generator=g).expand(n, r).contiguous(), returns=torch.randn(n, r, generator=g),
             values=0.1 * torch.randn(n, r, generator=g), ref_log_probs=-4.0 + 0.1 * torch.randn(n, r, generator=g))
    return Batch(tensors=t)


def _full(model: torch.nn.Module) -> tuple[dict, dict]:
    """(full gradients, full weights) of a model at any layout (collectives: every rank calls)."""
    grads = {n: to_full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    weights = {n: to_full(p.detach()).clone() for n, p in model.named_parameters()}
    return grads, weights


def run_role(root: Path, role: str, arch: str, layout: dict | None, rank: int = 0, world: int = 1, device: str = "cpu") -> dict:
    """One training step of `role` and what it changed, as every rank collects it."""
    config = role_config(root, role, arch, layout, device)
    if role == "actor":
        worker = ActorWorker(role_spec(config, "actor"), rank, world)
        worker.setup()
        batch = rl_batch()
        old = call(worker, "compute_log_prob", batch)
        metrics = call(worker, "update_actor", batch.union(old.select("old_log_probs")), SAMPLES_PER_PROMPT)[0]
        out = {"old_log_probs": old["old_log_probs"], "entropy": old["entropy"]}
    elif role == "critic":
        worker = CriticWorker(role_spec(config, "critic"), rank, world)
        worker.setup()
        batch = rl_batch()
        out = {"values": call(worker, "compute_values", batch)["values"]}
        metrics = call(worker, "update_critic", batch, SAMPLES_PER_PROMPT)[0]
        out["grads"], out["weights"] = _full(worker.model)  # before a root forward: FSDP2 then drops the root's gradients
        out["values_after"] = call(worker, "compute_values", batch)["values"]
    else:
        worker = RewardModelWorker(role_spec(config, "reward_model"), rank, world)
        worker.setup()
        metrics = call(worker, "update_reward_model", _pairs())[0]
        out = dict(zip(("grads", "weights"), _full(worker.model)))
        after = call(worker, "score_pairs", _pairs())
        out.update(chosen=after["chosen_scores"], rejected=after["rejected_scores"])
    out["metrics"] = metrics
    if role == "actor":
        out["grads"], out["weights"] = _full(worker.model)
        # the weight sync as the trainer streams it: bucket by bucket, assembled on rank 0
        plan = call(worker, "weight_bucket_plan")
        out["synced"] = {k: v.clone() for names in plan for k, v in call(worker, "gather_weight_bucket", names)}
        assert len(plan) > 1 and out["synced"].keys() >= out["weights"].keys()
    return out


FSDP_TP, SP_TP = {"data_parallel": 2, "tensor_parallel": 2}, {"sequence_parallel": 2, "tensor_parallel": 2}
# 4 ranks: each layout on each architecture, the roles crossed (every pair would double the launch's
# time); TP + SP has one data-parallel shard, so it is also tensor parallelism without FSDP.
CASES_4 = [("actor", "llama", FSDP_TP), ("actor", "qwen2-gqa", SP_TP), ("critic", "qwen2-gqa", FSDP_TP),
           ("critic", "llama", SP_TP), ("reward_model", "qwen2-gqa", FSDP_TP)]
# 2 ranks, tensor parallelism alone: the pair no 4-rank case has (reward model, Llama) and the tied
# head split over the vocabulary with nothing else (actor, Qwen2); the suite's cost decides the rest
CASES_2 = [("reward_model", "llama", {"tensor_parallel": 2}), ("actor", "qwen2-gqa", {"tensor_parallel": 2})]
EVERY_TP_2 = [(role, arch, {"tensor_parallel": 2}) for role in ("actor", "critic", "reward_model") for arch in ("llama", "qwen2-gqa")]


def _run_cases(rank: int, world: int, root: Path, cases: list, device: str = "cpu") -> dict:
    return {(role, arch, str(layout)): run_role(root, role, arch, layout, rank, world, device) for role, arch, layout in cases}


def check_step(got: dict, want: dict, what: str) -> None:
    for name, w in got.get("synced", {}).items():  # what the rollout gets is the model's weights, exactly
        assert torch.equal(w, got["weights"][name if name in got["weights"] else "model.embed_tokens.weight"]), f"{what}: {name}"
    for key in want:
        if key in ("metrics", "grads", "weights", "synced"):
            continue
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=f"{what}: {key}")
    for name, value in want["metrics"].items():
        if "compute_token" in name:  # Ulysses also computes the padding to an even length
            continue
        assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{what}: {name}"
    # key biases have a zero gradient in exact arithmetic (softmax ignores a shift every key shares):
    # theirs is float32 noise, compared at the scale of the model's other gradients
    floor = 1e-3 * max(float(g.abs().max()) for g in want["grads"].values())
    assert_grads_close(got["grads"], {n: g for n, g in want["grads"].items() if "k_proj.bias" not in n}, what)
    for name in [n for n in want["grads"] if "k_proj.bias" in n]:
        torch.testing.assert_close(got["grads"][name], want["grads"][name], atol=1e-4 * floor, rtol=0, msg=f"{what}: {name}")
    assert got["grads"].keys() == want["grads"].keys() and got["weights"].keys() == want["weights"].keys()
    for k, w in want["weights"].items():
        # AdamW's first steps are nearly sign(g) * lr: an entry whose gradient is float32 noise (an
        # embedding row seen once, say) may move by up to lr either way; every other one must match
        g = want["grads"][k]
        noise = g.abs() < 1e-3 * float(g.abs().max()) if k in want["grads"] else torch.ones_like(w, dtype=torch.bool)
        tol = torch.where(noise, torch.full_like(w, 2 * 2 * LR), torch.full_like(w, 1e-5))
        diff = (got["weights"][k] - w).abs()
        assert bool((diff <= tol).all()), f"{what}: {k} differs by {float(diff.max()):.3g}"


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["tp2", "fsdp2xtp2-and-tp2+sp2"])
def test_a_tensor_parallel_step_equals_the_one_process_step(tmp_path, world, cases):
    root = save_models(tmp_path / "models")
    ranks = launch(partial(_run_cases, root=root, cases=cases), world, tmp_path / "out")
    for role, arch, layout in cases:
        what = f"{role} {arch} {layout}"
        want = run_role(root, role, arch, None)
        assert want["metrics"][f"{'reward_model' if role == 'reward_model' else role}/grad_norm"] > 0, what
        for r, got in enumerate(ranks):
            check_step(got[role, arch, str(layout)], want, f"{what} rank {r}")
        if role == "actor":
            assert want["metrics"]["actor/kl_loss"] > 0 and float(want["entropy"].sum()) > 0
