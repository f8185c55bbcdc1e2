"""RayWorkerGroup on a local Ray cluster: dispatch, futures passed between groups, colocation,
remote exceptions with their traceback, a killed worker, and FSDP2 (2 ranks on gloo) giving the
same update as one process. On the session's cluster, one connection for the module."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.controller import ColocatedWorker, Dispatch, Worker, WorkerError, register
from rlcore.controller.group import _UNSET
from rlcore.controller.ray_backend import RayWorkerGroup, WorkerDiedError
from rlcore.controller.ray_placement import ResourcePool
from rlcore.protocol import Batch

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster(ray_local):
    """This process connected to the shared Ray (`ray_local`, 4 CPUs) for the module."""
    import gc
    import sys

    from rlcore.controller.ray_cluster import ensure_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ensure_ray(address=ray_local)
    yield
    gc.collect()  # free this job's object refs while it is still connected
    ray.shutdown()


def _explode(rank: int) -> None:
    raise ValueError(f"bad row on rank {rank}")


class Toy(Worker):
    def __init__(self, rank: int = 0, world_size: int = 1, tag: str = "toy"):
        super().__init__(rank, world_size)
        self.tag = tag

    @register(dispatch=Dispatch.DP_COMPUTE)
    def mark(self, batch: Batch) -> Batch:
        if "fail" in batch.info and self.rank == 1:
            _explode(self.rank)
        return Batch(tensors={"x2": batch["x"] * 2, "rank": torch.full((len(batch),), self.rank)})

    @register(dispatch=Dispatch.RANK_ZERO)
    def make(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.float32)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def total(self, arr: np.ndarray) -> float:
        return float(arr.sum()) + 1000 * self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> tuple[str, int]:
        return self.tag, os.getpid()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self, s: float) -> None:
        import time

        time.sleep(s)


def test_dp_split_pads_and_futures_pass_between_groups(cluster):
    pool = ResourcePool("p", 2, cpus_per_bundle=1.0)
    a = RayWorkerGroup(lambda r, ws: Toy(r, ws), 2, "a", pool=pool, share=0.5, distributed=False)
    b = RayWorkerGroup(lambda r, ws: Toy(r, ws), 2, "b", pool=pool, share=0.5, distributed=False)
    try:
        out = a.mark(Batch(tensors={"x": torch.arange(5.0)}))  # 5 rows over 2 ranks: one pad row
        assert out["x2"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert out["rank"].tolist() == [0, 0, 0, 1, 1]
        # a rank-zero future goes to the other group's workers as an ObjectRef: the controller
        # never fetches it
        fut = a.make_async(1000)
        assert b.total(fut) == [499500.0, 500500.0]
        assert fut._value is _UNSET
    finally:
        a.shutdown(), b.shutdown(), pool.remove()


def test_remote_exception_names_role_rank_method_with_traceback(cluster):
    g = RayWorkerGroup(lambda r, ws: Toy(r, ws), 2, "toy", distributed=False)
    try:
        batch = Batch(tensors={"x": torch.arange(4.0)}, info={"fail": True})
        with pytest.raises(WorkerError) as info:
            g.mark(batch)
        err = info.value
        assert (err.role, err.rank, err.method) == ("toy", 1, "mark")
        assert err.error == "ValueError: bad row on rank 1"
        assert "_explode" in err.remote_traceback and "test_ray_controller.py" in err.remote_traceback
        assert "role='toy' rank=1 method='mark'" in str(err)
        assert g.mark(Batch(tensors={"x": torch.arange(2.0)}))["x2"].tolist() == [0.0, 2.0]  # still usable
    finally:
        g.shutdown()


def test_killed_worker_is_a_clear_error_not_a_hang(cluster):
    g = RayWorkerGroup(lambda r, ws: Toy(r, ws), 2, "toy", distributed=False, call_timeout_s=scaled(90))
    try:
        pids = g.pids()
        fut = g.call_async("sleep", 60.0)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:  # a timeout would be WorkerTimeoutError
            fut.result()
        assert (info.value.role, info.value.rank, info.value.method) == ("toy", 1, "sleep")
        with pytest.raises(RuntimeError, match="unusable after rank 1 failed in 'sleep'"):
            g.pid()
    finally:
        g.shutdown()


class Reducing(Worker):
    """Ranks of a gloo group that all-reduce for a while, then return a shared array."""

    @register(dispatch=Dispatch.COLLECTIVE)
    def reduce_many(self, n: int) -> np.ndarray:
        import time

        import torch.distributed as dist

        t = torch.ones(64)
        for _ in range(n):
            dist.all_reduce(t)
            time.sleep(0.01)
        return np.ones(4, dtype=np.float32)


def test_a_rank_lost_mid_collective_is_named_through_a_passed_future(cluster):
    """Rank 1 dies in a collective whose future went on to another group as an ObjectRef: rank 0's
    collective breaks at once (gloo: connection closed by peer), the receiving call fails with
    it, and what is reported is the root cause, the dead rank of the producing group."""
    a = RayWorkerGroup(lambda r, ws: Reducing(r, ws), 2, "a", distributed=True, dist_backend="gloo", call_timeout_s=scaled(120))
    b = RayWorkerGroup(lambda r, ws: Toy(r, ws), 1, "b", distributed=False, call_timeout_s=scaled(120))
    try:
        pids = a.pids()
        produced = a.call_async("reduce_many", 3000)
        received = b.call_async("total", produced)  # the ref goes worker to worker
        import time

        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            received.result()
        assert (info.value.role, info.value.rank, info.value.method) == ("a", 1, "reduce_many")
        assert info.value.node_id and not info.value.node_lost  # the process died, its node is alive
        assert "the worker process died on node" in str(info.value)
        with pytest.raises(RuntimeError, match="unusable after rank 1 failed in 'reduce_many'"):
            a.pids()
    finally:
        a.shutdown(), b.shutdown()


def test_colocated_roles_share_one_process_per_rank(cluster):
    factory = lambda r, ws: ColocatedWorker({"x": Toy(r, ws, "x"), "y": Toy(r, ws, "y")}, r, ws)  # noqa: E731
    g = RayWorkerGroup(factory, 2, "x+y", distributed=False)
    try:
        xs, ys = g.view("x").pid(), g.view("y").pid()
        assert [t for t, _ in xs] == ["x", "x"] and [t for t, _ in ys] == ["y", "y"]
        assert [p for _, p in xs] == [p for _, p in ys] == g.pids()
        assert len(set(g.pids())) == 2
    finally:
        g.shutdown()


# ----- FSDP2 on gloo: 2 ranks update like 1 -----------------------------------------------------


def _update_batch(tokenizer_vocab: int, n: int = 8, p: int = 6, r: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([6, 2, 5, 3, 6, 1, 4, 6])[:n]
    resp_len = torch.tensor([5, 5, 1, 2, 4, 5, 3, 1])[:n]
    prompts = torch.randint(3, tokenizer_vocab, (n, p), generator=g)
    responses = torch.randint(3, tokenizer_vocab, (n, r), generator=g)
    pmask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()  # left-padded
    rmask = (torch.arange(r)[None, :] < resp_len[:, None]).long()
    attn = torch.cat([pmask, rmask], 1)
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "response_mask": rmask.float(), "advantages": torch.randn(n, 1, generator=g).expand(n, r).contiguous(),
        },
    )


def _grad_actor():
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.fsdp import to_full

    class GradActor(ActorWorker):
        """The actor plus a way to read the (full) gradients of the last update."""

        @register(dispatch=Dispatch.COLLECTIVE)
        def full_grads(self) -> dict[str, torch.Tensor]:
            return {n: to_full(p.grad).clone() for n, p in self.model.named_parameters() if p.grad is not None}

    return GradActor


def _adam_first_step(g: torch.Tensor, eps: float) -> torch.Tensor:
    """Adam's first update direction for gradient `g` (bias-corrected m / (sqrt(v) + eps))."""
    return g / (g.abs() + eps)


@pytest.mark.distributed  # 2 FSDP2 ranks on gloo
def test_fsdp2_two_ranks_update_equals_one_process(cluster, tmp_path):
    from rlcore.cli import CONFIG_DIR
    from rlcore.config import load_config, role_spec
    from rlcore.controller import InProcessWorkerGroup
    from rlcore.example.build import save_untrained_model
    from rlcore.workers.optim import build_optimizer

    # A seeded, untrained model made here: nothing in the comparison depends on weights trained on
    # this machine (the SFT example's weights, hence its near-zero gradients, vary by CPU).
    model_dir = save_untrained_model(tmp_path / "model", seed=0)
    ActorWorker = _grad_actor()
    base = [
        f"model.path={model_dir}", f"data.train_files=[{tmp_path / 'unused.parquet'}]",
        f"data.val_files=[{tmp_path / 'unused.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.device=cpu",
        "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0", "actor.optim.schedule=constant",
        "actor.optim.weight_decay=0",
        "actor.max_tokens_per_micro_batch=24",
    ]
    one_cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", base)
    two_cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", base + ["trainer.backend=ray", "actor.world_size=2"])
    lr = one_cfg.actor.optim.lr
    eps = build_optimizer(torch.nn.Linear(1, 1), one_cfg.actor.optim).defaults["eps"]
    one = InProcessWorkerGroup(lambda r, ws: ActorWorker(role_spec(one_cfg, "actor"), r, ws), 1, "actor")
    two = RayWorkerGroup(lambda r, ws: ActorWorker(role_spec(two_cfg, "actor"), r, ws), 2, "actor", call_timeout_s=scaled(120))
    try:
        start = {k: v.clone() for k, v in one.weights_for_rollout().result()}  # views otherwise
        vocab = start["lm_head.weight"].shape[0]
        batch = _update_batch(vocab)
        lp1, lp2 = one.compute_log_prob(batch), two.compute_log_prob(batch)
        # float32 forwards of differently split micro-batches (measured: equal bit for bit here)
        torch.testing.assert_close(lp2["old_log_probs"], lp1["old_log_probs"], atol=1e-5, rtol=1e-5)
        batch = batch.union(lp1.select("old_log_probs"))
        m1, m2 = one.update_actor(batch, 2), two.update_actor(batch, 2)
        for rank_metrics in m2:  # every rank reports the one-process loss (summed over ranks)
            assert rank_metrics["actor/grad_norm"] == pytest.approx(m1[0]["actor/grad_norm"], rel=1e-4)
            assert rank_metrics["actor/pg_loss"] == pytest.approx(m1[0]["actor/pg_loss"], rel=1e-4, abs=1e-7)
        w1 = dict(one.weights_for_rollout().result())
        w2 = dict(two.weights_for_rollout().result())
        assert set(w1) == set(w2)
        g1, g2 = one.full_grads(), two.full_grads()
        for k in g1:
            # Gradients (after the global-norm clip, as Adam saw them) agree to float32 summation
            # noise: the 2-rank all-reduce adds the same per-sample terms in another order. Measured:
            # typical entries 1e-5..1e-3, differences <= 3e-8 (embedding rows, sums over ~90
            # tokens' terms), <= 6e-9 elsewhere; atol 2e-7 leaves ~7x on the worst entry.
            torch.testing.assert_close(g2[k], g1[k], atol=2e-7, rtol=1e-4, msg=k)
        for k in g1:  # parameters (tied lm_head is embed_tokens), every entry
            # Adam's first step is lr * g / (|g| + eps): sign-like, so an entry whose gradient is
            # within float noise of 0 (some are, even here: |g| down to 1e-10) may move differently
            # in the two runs (measured: by up to 5e-6), by exactly what its two gradients imply.
            # So: the 2-rank update equals the 1-process one plus that predicted difference (~0
            # where the gradients are clear of noise). Tolerance: a few float32 ulps of weights up
            # to ~1 (ulp 1.2e-7); measured residual <= 8e-9, while a 1% different lr on 2 ranks
            # (1e-5 per entry) fails.
            step1, step2 = w1[k] - start[k], w2[k] - start[k]
            predicted = -lr * (_adam_first_step(g2[k], eps) - _adam_first_step(g1[k], eps))
            torch.testing.assert_close(step2 - step1, predicted, atol=1e-6, rtol=0, msg=k)
            # ...and that update is Adam's step, visible in every tensor: entries with |g| >> eps
            # move by ~lr = 1e-3, far beyond the tolerance.
            torch.testing.assert_close(step1, -lr * _adam_first_step(g1[k], eps), atol=1e-6, rtol=0, msg=k)
            assert float(step1.abs().max()) > 0.5 * lr, k
        # the bucketed path gathers the same tensors
        plan = two.weight_bucket_plan()
        streamed = dict(item for names in plan for item in two.gather_weight_bucket(names))
        assert all(torch.equal(streamed[k], w2[k]) for k in w2)
    finally:
        one.shutdown(), two.shutdown()


@pytest.mark.distributed  # 2 FSDP2 ranks on gloo
def test_fsdp2_lora_two_ranks_update_equals_one_process(cluster, tmp_path):
    """LoRA under FSDP2 (frozen sharded base, sharded adapter): 2 gloo ranks take the 1-process step
    (loss, grad norm, adapter gradients and Adam's step), serve the same reference log-probs with the
    adapter disabled and send the same merged weights; a sharded checkpoint (adapter + DCP of the
    trained parameters only) resumes in one process with the same adapter."""
    from rlcore.cli import CONFIG_DIR
    from rlcore.config import load_config, role_spec
    from rlcore.controller import InProcessWorkerGroup
    from rlcore.example.build import save_untrained_model
    from rlcore.workers.optim import build_optimizer

    model_dir = save_untrained_model(tmp_path / "model", seed=0)
    ActorWorker = _grad_actor()
    base = [
        f"model.path={model_dir}", f"data.train_files=[{tmp_path / 'unused.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.device=cpu",
        "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0", "actor.optim.weight_decay=0", "actor.max_tokens_per_micro_batch=24",
        "actor.lora.rank=4", "actor.lora.alpha=8", "algorithm.use_reference=true",
    ]
    one_cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", base)
    two_cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", base + ["trainer.backend=ray", "actor.world_size=2"])
    lr = one_cfg.actor.optim.lr
    eps = build_optimizer(torch.nn.Linear(1, 1), one_cfg.actor.optim).defaults["eps"]
    one = InProcessWorkerGroup(lambda r, ws: ActorWorker(role_spec(one_cfg, "actor"), r, ws), 1, "actor")
    two = RayWorkerGroup(lambda r, ws: ActorWorker(role_spec(two_cfg, "actor"), r, ws), 2, "actor", call_timeout_s=scaled(120))
    try:
        start = {k: v.clone() for k, v in one.adapter_for_rollout().result()[0].items()}
        batch = _update_batch(int(one.workers[0].model.get_output_embeddings().weight.shape[0]))
        batch = batch.union(one.compute_log_prob(batch).select("old_log_probs"))
        m1, m2 = one.update_actor(batch, 2), two.update_actor(batch, 2)
        for rank_metrics in m2:
            assert rank_metrics["actor/grad_norm"] == pytest.approx(m1[0]["actor/grad_norm"], rel=1e-4)
            assert rank_metrics["actor/pg_loss"] == pytest.approx(m1[0]["actor/pg_loss"], rel=1e-4, abs=1e-7)
            assert rank_metrics["actor/trainable_params"] == m1[0]["actor/trainable_params"] < m1[0]["actor/total_params"]
        g1, g2 = one.full_grads(), two.full_grads()
        assert g1.keys() == g2.keys() and all(".lora_" in k for k in g1)  # only the adapter trains
        a1, a2 = one.adapter_for_rollout().result()[0], two.adapter_for_rollout().result()[0]
        assert a1.keys() == a2.keys() == start.keys()
        for k in a1:  # peft's file name of each adapter tensor -> its parameter name
            param = k.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
            torch.testing.assert_close(g2[param], g1[param], atol=2e-7, rtol=1e-4, msg=k)
            step1, step2 = a1[k] - start[k], a2[k] - start[k]  # Adam's first step, sign-like: see the test above
            predicted = -lr * (_adam_first_step(g2[param], eps) - _adam_first_step(g1[param], eps))
            torch.testing.assert_close(step2 - step1, predicted, atol=1e-6, rtol=0, msg=k)
        assert any(float((a1[k] - start[k]).abs().max()) > 0.5 * lr for k in a1 if ".lora_B." in k)  # B moved
        torch.testing.assert_close(two.compute_ref_log_prob(batch)["ref_log_probs"],
                                   one.compute_ref_log_prob(batch)["ref_log_probs"], atol=1e-5, rtol=0)
        w1 = dict(one.weights_for_rollout().result())
        w2 = dict(two.weights_for_rollout().result())
        assert w1.keys() == w2.keys()
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=0, msg=k)
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        two.save_checkpoint(str(ckpt))
        assert sorted(p.name for p in ckpt.iterdir()) == ["actor_adapter", "actor_dcp", "actor_scheduler.pt"]
        dcp_bytes = sum(p.stat().st_size for p in (ckpt / "actor_dcp").iterdir())
        assert dcp_bytes < 0.5 * (model_dir / "model.safetensors").stat().st_size  # adapter + its Adam state only
        back = InProcessWorkerGroup(lambda r, ws: ActorWorker(role_spec(one_cfg, "actor"), r, ws), 1, "actor")
        back.load_checkpoint(str(ckpt))
        restored = back.adapter_for_rollout().result()[0]
        assert all(torch.equal(restored[k], a2[k]) for k in a2)
        opt = back.workers[0].optimizer
        assert all(int(opt.state[p]["step"]) == 1 for g in opt.param_groups for p in g["params"])
        back.shutdown()
    finally:
        one.shutdown(), two.shutdown()


def test_a_layout_the_cluster_cannot_hold_is_refused_before_anything_is_placed(cluster, ray_local, tiny_example,
                                                                              tmp_path, capsys):
    """`rlcore train` with actor.layout={data_parallel: 100000} on the shared cluster (4 CPUs):
    exit 2 and one line naming the key, what the pool needs and what the cluster has, with no
    placement group or worker made (it sat silent until killed before)."""
    from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides

    groups_before = set(ray.util.placement_group_table())
    code = main(["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(tmp_path / "run")),
                 "trainer.backend=ray", f"ray.address={ray_local}", "actor.layout={data_parallel: 100000}",
                 "trainer.val_before_train=false"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlcore:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("rlcore: error: actor.layout (data_parallel=100000 x sequence_parallel=1 x "
                               "tensor_parallel=1 = 100000 ranks): pool 'default' (ray.pools.default) needs 100000 "
                               "bundles of {CPU: 1}, PACK ({CPU: 100000} in all), and the cluster has room for 4: "
                               "{CPU: 4, GPU: 0} on 1 live node"), lines[0]
    assert "Traceback" not in err
    assert set(ray.util.placement_group_table()) == groups_before


def test_an_autoscaling_cluster_is_refused_only_beyond_its_ceiling(cluster, caplog):
    """A cluster whose autoscaler reported a ceiling to the GCS (as Ray's autoscaler does: the
    cluster config under its key, planted here on the shared cluster and removed after) may grow:
    pools within the ceiling are let through to wait for nodes, said at once; beyond it, refused."""
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    from rlcore.controller.ray_placement import PlacementError, PoolDemand, bundle_of, check_placement

    key, namespace = ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE
    config = autoscaler_pb2.ClusterConfig(max_resources={"CPU": 64}, node_group_configs=[
        autoscaler_pb2.NodeGroupConfig(name="cpu", resources={"CPU": 8}, max_count=8)])
    within = [PoolDemand("default", 32, bundle_of(1), why="actor.world_size=32")]
    beyond = [PoolDemand("default", 100000, bundle_of(1), why="actor.world_size=100000")]
    with pytest.raises(PlacementError, match=r"room for 4: \{CPU: 4, GPU: 0\} on 1 live node$"):
        check_placement(within, local=False)  # no autoscaler: the cluster is what it has
    _internal_kv_put(key, config.SerializeToString(), namespace=namespace)
    try:
        with caplog.at_level("WARNING", logger="rlcore.controller.ray_placement"):
            check_placement(within, local=False)
        assert "its autoscaler may add nodes (up to {CPU: 64}): the pools wait up to 120 s for them" in caplog.text
        with pytest.raises(PlacementError, match=r"and its autoscaler grows it to at most \{CPU: 64\}"):
            check_placement(beyond, local=False)
    finally:
        _internal_kv_del(key, namespace=namespace)
