"""Ulysses sequence parallelism (`actor.ulysses_sequence_parallel_size`) and gradient checkpointing.

Two gloo ranks that split every packed row along its tokens (all-to-all over attention heads
around attention) compute what one process computes: log-probs, entropies, critic values, the
policy loss and its gradients, on a Llama (multi-head), a Qwen2 with grouped-query attention (2
key/value heads for 4 query heads) and a Qwen2 with one key/value head (repeated for each rank),
with and without gradient checkpointing; through the real workers (Ray, FSDP2 over both ranks,
actor + reference + critic colocated) an update step equals the one-process step. Also: the
slices cover the row, the dispatch gives every rank of a group the same rows, refusals name the
config key; gradient checkpointing changes neither loss nor gradients on the packed path.
Tolerances: float32 sums in another order (1e-5 on log-probs and losses, gradients 1e-4 of each
parameter's largest entry).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import spawn  # tests/ is on sys.path
from net import free_port  # tests/ is on sys.path
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)
from tiny_models import ARCHS, SIZES, VOCAB, assert_grads_close, tiny_model  # tests/ is on sys.path
from transformers import Qwen2Config

from rlcore.algos import get_policy_loss
from rlcore.config import ActorConfig, ConfigError, load_config, role_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.controller.dispatch import plan_dispatch
from rlcore.data.preference import sequence_tensors
from rlcore.protocol import Batch
from rlcore.workers.actor import PolicyObjective
from rlcore.workers.forward import response_values
from rlcore.workers.loops import GlobalCounts
from rlcore.workers.packed import pack_rows
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.ulysses import enable_sequence_parallel, head_problem


def _batch(seed: int = 0) -> Batch:
    """Rows of varied lengths (one response empty, one with interior mask zeros): 40 real tokens,
    so the two slices cut through a sequence."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [7, 2, 5, 3, 6], [9, 1, 0, 4, 3]
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in response_lens]
    t = sequence_tensors(prompts, responses, pad_id=0)
    t["response_mask"][3, 1:3] = 0.0
    n, r = t["responses"].shape
    t.update(advantages=torch.randn(n, 1, generator=g).expand(n, r).contiguous(),
             old_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g), ref_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g))
    return Batch(tensors=t)


def _shared_batch() -> Batch:
    """`_batch` plus rows that repeat rows 0's and 2's prompts with responses of their own (what
    `model.share_prompt_prefix` holds once per packed row)."""
    batch = _batch()
    g = torch.Generator().manual_seed(1)
    t = {k: v for k, v in batch.tensors.items()}
    p = t["input_ids"].shape[1] - t["responses"].shape[1]
    extra = sequence_tensors([t["input_ids"][i, p - n:].tolist()[:n] for i, n in ((0, 7), (0, 7), (2, 5))],
                             [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 2)], pad_id=0,
                             prompt_width=p, response_width=t["responses"].shape[1])
    r = t["responses"].shape[1]
    extra.update(advantages=torch.randn(3, 1, generator=g).expand(3, r).contiguous(),
                 old_log_probs=-3.0 + 0.1 * torch.randn(3, r, generator=g), ref_log_probs=-3.0 + 0.1 * torch.randn(3, r, generator=g))
    return Batch.concat([batch, Batch(tensors=extra, info=dict(batch.info))])


ACTOR = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, loss_agg_mode="seq-mean-token-mean", logprob_chunk_tokens=7)
LOG_PROBS = PolicyLogProbs(0.9, chunk_tokens=7, backend="torch")
SHARED_LOG_PROBS = PolicyLogProbs(0.9, chunk_tokens=7, backend="torch", share_prompts=True)


def _loss_and_grads(model: torch.nn.Module, batch: Batch, counts: GlobalCounts, log_probs: PolicyLogProbs = LOG_PROBS,
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    """The actor's loss on `batch` normalised by `counts`, and its gradients."""
    model.zero_grad(set_to_none=True)
    objective = PolicyObjective(ACTOR, get_policy_loss("vanilla"), log_probs, model)
    out = objective(batch, counts)(batch)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _counts(batch: Batch, ranks: int = 1) -> GlobalCounts:
    """What the update loop sums over ranks: each of `ranks` ranks holding `batch`."""
    return GlobalCounts(ranks * float(batch["response_mask"].sum()), ranks * float(len(batch)))


# ----- the slices, the dispatch, the refusals (one process) ----------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3])
def test_slices_cover_the_packed_row_and_every_scored_token_once(size):
    batch = _batch()
    packed = pack_rows(batch["attention_mask"], batch["responses"].shape[1])
    shards = [packed.shard(rank, size) for rank in range(size)]
    width = -(-packed.tokens // size)
    assert all(s.tokens == width for s in shards)
    assert sum(s.real_tokens for s in shards) == packed.tokens == 40
    torch.testing.assert_close(torch.cat([s.token_index[: s.real_tokens] for s in shards]), packed.token_index)
    torch.testing.assert_close(torch.cat([s.position_ids[0, : s.real_tokens] for s in shards]), packed.position_ids[0])
    assert all(int(s.cu_seqlens[-1]) == width * size and sum(s.seq_lens) == width * size for s in shards)
    # every scored response token is scored on exactly one rank, from the same hidden state
    owners = torch.cat([s.response_index for s in shards])
    assert sorted(owners.tolist()) == packed.response_index.tolist()
    global_pred = torch.cat([s.predictor_index + r * width for r, s in enumerate(shards)])
    order = torch.argsort(owners)
    torch.testing.assert_close(global_pred[order], packed.predictor_index)


def test_dispatch_sends_a_shard_to_every_rank_of_its_group():
    batch = Batch(tensors={"x": torch.arange(6.0), "attention_mask": torch.ones(6, 3, dtype=torch.long)})
    for mode in (Dispatch.DP_COMPUTE, Dispatch.DP_BALANCED):
        plan = plan_dispatch(mode, 4, (batch,), {}, ranks_per_shard=2)
        parts = [call[1][0]["x"].tolist() for call in plan.calls]
        assert [c[0] for c in plan.calls] == [0, 1, 2, 3]
        assert parts[0] == parts[1] and parts[2] == parts[3] and len(parts[0]) == 3
        assert sorted(parts[0] + parts[2]) == list(range(6))
        # collected from each group's first rank: the others' results are not looked at
        results = [Batch(tensors={"y": call[1][0]["x"] * (10 if r % 2 == 0 else -1)}) for r, call in enumerate(plan.calls)]
        assert plan.collect(results)["y"].tolist() == [10.0 * i for i in range(6)]

    class Grouped(Worker):
        ranks_per_shard = 2

        @register(dispatch=Dispatch.DP_COMPUTE)
        def f(self, batch: Batch) -> Batch:
            return batch

    assert Grouped(0, 2).registered_methods()["f"].ranks_per_shard == 2
    assert Worker(0, 1).registered_methods() == {}


def test_sizes_that_do_not_fit_are_refused_naming_the_key(tmp_path):
    base = ["model.path=m", "data.train_files=[t.parquet]", "trainer.backend=ray", "actor.world_size=2"]
    with pytest.raises(ConfigError, match=r"actor.ulysses_sequence_parallel_size=3 does not divide actor.world_size=2"):
        load_config(None, [*base, "actor.ulysses_sequence_parallel_size=3"])
    with pytest.raises(ConfigError, match="needs model.use_remove_padding=true"):
        load_config(None, [*base, "actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=false"])
    ppo = [*base, "algorithm.name=ppo", "algorithm.adv_estimator=gae", "actor.ulysses_sequence_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"critic.ulysses_sequence_parallel_size=2 \(default: the actor's\) does not divide critic.world_size=1"):
        load_config(None, ppo)
    assert load_config(None, [*ppo, "critic.ulysses_sequence_parallel_size=1"]).critic_sequence_parallel_size == 1
    assert head_problem(4, 2, 2) is None and head_problem(4, 1, 2) is None and head_problem(8, 2, 4) is None
    assert "3 attention heads" in head_problem(3, 3, 2) and "3 key/value heads" in head_problem(6, 3, 2)
    with pytest.raises(ValueError, match=r"actor.ulysses_sequence_parallel_size=2 does not divide the 1 ranks"):
        enable_sequence_parallel(tiny_model("llama"), 2, torch.device("cpu"), "actor.ulysses_sequence_parallel_size")
    # the heads, from config.json, before any model loads (preflight)
    from rlcore.workers.parallel.shapes import layout_problems

    Qwen2Config(**SIZES, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path / "m")
    cfg = load_config(None, [*ppo, f"model.path={tmp_path / 'm'}", "critic.ulysses_sequence_parallel_size=1"])
    assert layout_problems(cfg) == [
        f"actor.ulysses_sequence_parallel_size=2: the model's 3 key/value heads neither divide by 2 nor divide 2 "
        f"({tmp_path / 'm'}; Ulysses splits a rank's attention heads over its sequence-parallel group)"]


# ----- gradient checkpointing ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2-gqa"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(arch):
    """`model.gradient_checkpointing`: the packed forward recomputed layer by layer in backward
    gives the loss and gradients of the stored-activation forward, actor and critic (the check
    that checkpointing is really on: the model says so, and is in train mode)."""
    batch = _batch()
    plain, ckpt = tiny_model(arch), tiny_model(arch, checkpointing=True)
    ckpt.train(), plain.train()
    assert ckpt.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    want_loss, want = _loss_and_grads(plain, batch, _counts(batch))
    got_loss, got = _loss_and_grads(ckpt, batch, _counts(batch))
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    assert_grads_close(got, want, "actor")
    values = {}
    for name, model in (("plain", tiny_model(arch, "value")), ("ckpt", tiny_model(arch, "value", checkpointing=True))):
        model.train()
        v = response_values(model, batch)
        (v * batch["response_mask"]).pow(2).sum().backward()
        values[name] = (v.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(values["ckpt"][0], values["plain"][0], atol=1e-6, rtol=0)
    assert_grads_close(values["ckpt"][1], values["plain"][1], "critic")


# ----- two gloo ranks against one process --------------------------------------------------------------


# every architecture, checkpointing on the Llama, prompts shared in the packed row on the Qwen2 with GQA
SP_CASES = [("llama", "plain"), ("llama", "checkpointing"), ("qwen2-gqa", "plain"), ("qwen2-1kv", "plain"), ("qwen2-gqa", "shared")]


def _sp_rank(rank: int, world_size: int, port: int, work: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out = {}
        for arch, variant in SP_CASES:
            shared = variant == "shared"
            batch, log_probs = (_shared_batch(), SHARED_LOG_PROBS) if shared else (_batch(), LOG_PROBS)
            model = tiny_model(arch, checkpointing=variant == "checkpointing")
            enable_sequence_parallel(model, world_size, torch.device("cpu"), "actor.ulysses_sequence_parallel_size")
            model.train()
            with torch.no_grad():
                logp, entropy = log_probs(model, batch, compute_entropy=True)
            # both ranks hold the batch: the counts summed over ranks are twice its own
            loss_share, grads = _loss_and_grads(model, batch, _counts(batch, world_size), log_probs)
            for g in grads.values():
                dist.all_reduce(g)  # what FSDP's reduction sums
            loss = torch.tensor([loss_share])
            dist.all_reduce(loss)
            critic = tiny_model(arch, "value", seed=1, checkpointing=variant == "checkpointing")
            enable_sequence_parallel(critic, world_size, torch.device("cpu"), "critic.ulysses_sequence_parallel_size")
            values = response_values(critic, batch, share_prompts=shared)
            out[arch, variant] = dict(logp=logp, entropy=entropy, loss=float(loss), grads=grads, values=values.detach())
        torch.save(out, work / f"sp_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed  # 2 gloo processes
def test_two_sequence_parallel_ranks_compute_what_one_process_does(tmp_path):
    spawn(_sp_rank, (2, free_port(), tmp_path), 2)
    ranks = [torch.load(tmp_path / f"sp_rank{r}.pt", weights_only=False) for r in range(2)]
    for arch, variant in ranks[0]:
        what = f"{arch} ({variant})"
        shared = variant == "shared"
        batch, log_probs = (_shared_batch(), SHARED_LOG_PROBS) if shared else (_batch(), LOG_PROBS)
        model = tiny_model(arch)
        model.train()
        with torch.no_grad():
            logp, entropy = log_probs(model, batch, compute_entropy=True)
        loss, grads = _loss_and_grads(model, batch, _counts(batch), log_probs)
        values = response_values(tiny_model(arch, "value", seed=1), batch, share_prompts=shared).detach()
        assert float(logp.abs().sum()) > 1.0 and float(values.abs().sum()) > 0.1
        for r in ranks:
            got = r[arch, variant]
            torch.testing.assert_close(got["logp"], logp, atol=1e-5, rtol=0, msg=what)
            torch.testing.assert_close(got["entropy"], entropy, atol=1e-5, rtol=0, msg=what)
            torch.testing.assert_close(got["values"], values, atol=1e-5, rtol=0, msg=what)
            assert got["loss"] == pytest.approx(loss, abs=1e-5), what
            assert_grads_close(got["grads"], grads, what)
    assert list(ranks[0]) == SP_CASES


# ----- through the workers: Ray, FSDP2 over both ranks, actor + reference + critic colocated ----------


def _worker_batch(n: int = 6) -> Batch:
    g = torch.Generator().manual_seed(3)
    t = sequence_tensors([torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (9, 3, 6, 2, 7, 4)][:n],
                         [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (8, 2, 5, 7, 1, 6)][:n], pad_id=0)
    r = t["responses"].shape[1]
    t.update(advantages=torch.randn(n, 1, generator=g).expand(n, r).contiguous(), returns=torch.randn(n, r, generator=g),
             values=0.1 * torch.randn(n, r, generator=g), ref_log_probs=-4.0 + 0.1 * torch.randn(n, r, generator=g))
    return Batch(tensors=t)


def _colocated(cfg):
    """actor (with its full gradients readable), reference and critic in one process per rank."""
    from rlcore.controller import ColocatedWorker
    from rlcore.workers.actor import ActorWorker, ReferenceWorker
    from rlcore.workers.critic import CriticWorker
    from rlcore.workers.fsdp import to_full

    class GradActor(ActorWorker):
        @register(dispatch=Dispatch.COLLECTIVE)
        def full_grads(self) -> dict[str, torch.Tensor]:
            return {n: to_full(p.grad).clone() for n, p in self.model.named_parameters()}

    def factory(rank: int, world_size: int) -> ColocatedWorker:
        workers = {"actor": GradActor(role_spec(cfg, "actor"), rank, world_size), "ref": ReferenceWorker(role_spec(cfg, "ref"), rank, world_size),
                   "critic": CriticWorker(role_spec(cfg, "critic"), rank, world_size)}
        return ColocatedWorker(workers, rank, world_size)

    return factory


def _step(group) -> dict:
    """One PPO-style pass of the three roles on `_worker_batch()`, and what it changed."""
    actor, ref, critic = group.view("actor"), group.view("ref"), group.view("critic")
    batch = _worker_batch()
    out = {"old": actor.compute_log_prob(batch), "ref": ref.compute_ref_log_prob(batch), "values": critic.compute_values(batch)}
    batch = batch.union(out["old"].select("old_log_probs"))
    out["critic_metrics"] = critic.update_critic(batch, 2)[0]
    out["actor_metrics"] = actor.update_actor(batch, 2)[0]
    out["grads"] = actor.full_grads()
    out["weights"] = {k: v.clone() for k, v in actor.weights_for_rollout().result()}
    out["values_after"] = critic.compute_values(batch)
    return out


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.distributed  # 2 sequence-parallel ranks on gloo
def test_sequence_parallel_workers_step_as_one_process(tmp_path, ray_driver):
    """Two Ray ranks, one sequence-parallel group (actor.world_size=2, size 2, FSDP2 over both),
    gradient checkpointing on, several micro-batches: log-probs, reference log-probs, values, the
    critic's and the actor's update (loss, gradient norm, full gradients, new weights) are the
    one-process ones; the tokens each rank computed add up to the real ones plus the padding to
    an even length."""
    import sys

    ray = pytest.importorskip("ray")
    from rlcore.controller import InProcessWorkerGroup, RayWorkerGroup

    config, lm, values = ARCHS["qwen2-gqa"]
    torch.manual_seed(0)
    lm(config).save_pretrained(tmp_path / "policy")
    values(config.__class__(**{**config.to_dict(), "num_labels": 1, "classifier_dropout": 0.0})).save_pretrained(tmp_path / "critic")
    base = [f"model.path={tmp_path / 'policy'}", f"critic.model_path={tmp_path / 'critic'}", "data.train_files=[unused.parquet]",
            "trainer.device=cpu", "algorithm.name=ppo", "algorithm.adv_estimator=gae", "data.train_batch_size=3",
            "actor.ppo_mini_batch_size=3", "rollout.n=2", "actor.max_tokens_per_micro_batch=24", "actor.use_kl_loss=true",
            "actor.entropy_coeff=0.01", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "actor.logprob_chunk_tokens=5",
            "model.gradient_checkpointing=true", "algorithm.use_reference=true"]
    one_cfg = load_config(None, base)
    sp_cfg = load_config(None, [*base, "trainer.backend=ray", "actor.world_size=2", "critic.world_size=2",
                                "actor.ulysses_sequence_parallel_size=2"])
    one = _step(InProcessWorkerGroup(_colocated(one_cfg), 1, "actor+ref+critic"))

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    group = RayWorkerGroup(_colocated(sp_cfg), 2, "actor+ref+critic", call_timeout_s=scaled(300))
    assert group.methods["actor.update_actor"].ranks_per_shard == group.methods["critic.compute_values"].ranks_per_shard == 2
    two = _step(group)
    group.shutdown()

    for key, name in (("old", "old_log_probs"), ("old", "entropy"), ("ref", "ref_log_probs"), ("values", "values"),
                      ("values_after", "values")):
        torch.testing.assert_close(two[key][name], one[key][name], atol=1e-5, rtol=0, msg=f"{key}/{name}")
    assert not torch.allclose(one["values_after"]["values"], one["values"]["values"], atol=1e-3)  # the critic stepped
    for role in ("critic_metrics", "actor_metrics"):
        for name, value in one[role].items():
            if "compute_token" in name:  # SP=2 also computes the padding to an even length
                continue
            assert two[role][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (role, name)
    m1, m2 = one["actor_metrics"], two["actor_metrics"]
    assert m1["actor/kl_loss"] > 0 and m1["actor/pg_loss"] != 0
    assert m2["perf/actor_real_tokens"] == m1["perf/actor_real_tokens"] == m1["perf/actor_compute_tokens"]
    assert 0 <= m2["perf/actor_compute_tokens"] - m1["perf/actor_compute_tokens"] <= m2["perf/actor_real_tokens"] / 10
    assert_grads_close(two["grads"], one["grads"], "actor")
    for k, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][k], w, atol=2e-6, rtol=0, msg=k)
