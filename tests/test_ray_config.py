"""Fast checks for what the Ray backend adds outside Ray: config fields and their errors, the
COLLECTIVE dispatch, `wg.method_async`, and futures passed as arguments (in-process backend)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlcore.config import ConfigError, load_config
from rlcore.controller import Dispatch, InProcessWorkerGroup, Worker, register
from rlcore.trainer.roles import _units

BASE = ["model.path=m", "data.train_files=[t.parquet]"]


def _load(*extra: str):
    return load_config(None, BASE + list(extra))


def test_defaults_keep_the_in_process_backend():
    cfg = _load()
    assert cfg.trainer.backend == "inprocess" and cfg.actor.world_size == 1
    assert cfg.ray.address is None and cfg.ray.pool_of("actor") == "default"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.world_size=2"], "actor.world_size=2 needs trainer.backend=ray"),
        (["critic.world_size=2"], "critic.world_size=2 needs trainer.backend=ray"),
        (["trainer.backend=ray", "ray.roles={actor: big}"], "ray.roles.actor: unknown pool 'big'"),
        (["trainer.backend=ray", "ray.roles={actr: default}"], "ray.roles: unknown role 'actr'"),
        (["trainer.backend=ray", "ray.pools={a: {}, b: {}}", "ray.roles={actor: a, ref: b, rollout: a, reward: a}",
          "ray.colocate=[[actor, ref]]"], "ray.colocate: ['actor', 'ref'] must map to one pool"),
        (["trainer.backend=ray", "ray.pools={train: {}}", "ray.roles={actor: train}"],
         "roles ['rollout', 'reward'] use pool 'default', which is not defined"),
        (["trainer.backend=ray", "ray.pools.default.cpus_per_bundle=-1"], "ray.pools.default.cpus_per_bundle"),
        (["trainer.backend=ray", "ray.pools.default.resources={CPU: 2}"],
         "ray.pools.default.resources: .*'CPU' is set by cpus_per_bundle"),
        (["trainer.backend=ray", "ray.pools.default.resources={node_a: 0}"], "ray.pools.default.resources: .*must be > 0"),
        (["trainer.backend=ray", "ray.pools.default.label_selector={pool: 'in(a,'}"],
         "ray.pools.default.label_selector: .*Invalid label selector value"),
    ],
)
def test_bad_ray_settings_name_the_key(overrides, message):
    pattern = message if ".*" in message else message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ConfigError, match=pattern):
        _load(*overrides)


def test_pool_placement_keys_and_ray_address_from_the_environment(monkeypatch):
    cfg = _load("trainer.backend=ray", "ray.pools.default.resources={node_a: 1}",
                "ray.pools.default.label_selector={pool: train, zone: '!us-east'}")
    assert cfg.ray.pools["default"].resources == {"node_a": 1.0}
    assert cfg.ray.pools["default"].label_selector == {"pool": "train", "zone": "!us-east"}
    from rlcore.controller.ray_cluster import ensure_ray

    # a dashboard URL in RAY_ADDRESS (as `ray job submit` users set it) is refused, naming the key
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(ValueError, match="is a dashboard \\(job server\\) URL; ray.address"):
        ensure_ray()


def test_colocated_roles_become_one_unit_and_must_share_world_size():
    cfg = _load("trainer.backend=ray", "actor.world_size=2", "ray.colocate=[[actor, rollout]]")
    roles = {"actor": SimpleNamespace(world_size=2), "rollout": SimpleNamespace(world_size=1), "reward": SimpleNamespace(world_size=1)}
    with pytest.raises(ValueError, match="different world sizes"):
        _units(cfg.ray, roles)  # type: ignore[arg-type]
    roles["rollout"] = SimpleNamespace(world_size=2)
    assert _units(cfg.ray, roles) == [["actor", "rollout"], ["reward"]]  # type: ignore[arg-type]


class Counter(Worker):
    @register(dispatch=Dispatch.COLLECTIVE)
    def who(self) -> int:
        return 100 + self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return x + self.rank


def test_collective_returns_rank_zero_and_futures_are_resolved_as_arguments():
    g = InProcessWorkerGroup(lambda r, ws: Counter(r, ws), world_size=3, role="c")
    assert g.who() == 100
    fut = g.who_async()
    assert g.add(fut) == [100, 101, 102]
    with pytest.raises(AttributeError, match="no registered method 'nope_async'"):
        g.nope_async()


# ---------------------------------------------------------------------- placement on the cluster

def _node(cpu: float, gpu: float = 0, alive: bool = True, labels: dict | None = None, **custom: float) -> dict:
    """One entry of `ray.nodes()` as Ray 2.60 returns it (the fields the placement check reads)."""
    return {"Alive": alive, "Resources": {"CPU": cpu, "GPU": gpu, "memory": 8e9, **custom}, "Labels": labels or {}}


def _demands(*overrides: str) -> list:
    from rlcore.trainer.roles import _units, placement, pool_demands

    cfg = _load("trainer.backend=ray", *overrides)
    roles = placement(cfg).roles
    pools: dict[str, list[list[str]]] = {}
    for unit in _units(cfg.ray, roles):
        pools.setdefault(cfg.ray.pool_of(unit[0]), []).append(unit)
    return pool_demands(cfg.ray, roles, pools)


def test_each_pool_asks_for_a_bundle_per_rank_of_its_largest_group_naming_the_key():
    [pool] = _demands("actor.layout={data_parallel: 100000}")
    assert (pool.name, pool.bundles, pool.bundle) == ("default", 100000, {"CPU": 1.0})
    assert pool.why == "actor.layout (data_parallel=100000 x sequence_parallel=1 x tensor_parallel=1 = 100000 ranks)"
    train, gen = _demands("actor.world_size=4", "rollout.world_size=3", "ray.pools={train: {gpus_per_bundle: 1, "
                          "strategy: STRICT_SPREAD, label_selector: {pool: train}}, gen: {cpus_per_bundle: 2}}",
                          "ray.roles={actor: train, ref: train, rollout: gen, reward: gen}")
    assert (train.bundles, train.bundle, train.strategy, train.label_selector, train.why) == (
        4, {"CPU": 1.0, "GPU": 1.0}, "STRICT_SPREAD", {"pool": "train"}, "actor.world_size=4")
    assert (gen.bundles, gen.bundle, gen.why) == (3, {"CPU": 2.0}, "rollout.world_size=3")


@pytest.mark.parametrize("overrides, nodes, ceiling, local, verdict, says", [
    # the layout on the local Ray rlcore starts (this machine: 2 cores)
    (["actor.layout={data_parallel: 100000}"], [_node(2)], None, True, "refuse",
     "actor.layout (data_parallel=100000 x sequence_parallel=1 x tensor_parallel=1 = 100000 ranks): pool 'default' "
     "(ray.pools.default) needs 100000 bundles of {CPU: 1}, PACK ({CPU: 100000} in all), and the cluster has room for "
     "2: {CPU: 2, GPU: 0} on 1 live node (the local Ray"),
    # GPUs the machine does not have
    (["actor.world_size=2", "ray.pools.default.gpus_per_bundle=1"], [_node(8)], None, True, "refuse",
     "actor.world_size=2: pool 'default' (ray.pools.default) needs 2 bundles of {CPU: 1, GPU: 1}, PACK ({CPU: 2, GPU: 2} "
     "in all), and the cluster has room for 0: {CPU: 8, GPU: 0} on 1 live node"),
    # a cluster: one node per rank, on nodes with a label
    (["actor.world_size=3", "ray.pools.default.strategy=STRICT_SPREAD", "ray.pools.default.label_selector={pool: train}"],
     [_node(4, labels={"pool": "train"}), _node(4, labels={"pool": "train"}), _node(16, labels={"pool": "gen"})], None,
     False, "refuse", "needs 3 bundles of {CPU: 1}, each on its own node (STRICT_SPREAD) on nodes labelled {'pool': "
     "'train'} ({CPU: 3} in all), and the cluster has room for 2: {CPU: 24, GPU: 0} on 3 live nodes, 2 labelled"),
    (["actor.world_size=4", "ray.pools.default.strategy=STRICT_PACK"], [_node(2), _node(2)], None, False, "refuse",
     "all on one node (STRICT_PACK)"),
    # custom resources only some nodes have; 'in(...)' and '!' selectors
    (["actor.world_size=2", "ray.pools.default.resources={node_a: 1}"], [_node(8, node_a=1), _node(8)], None, False,
     "refuse", "needs 2 bundles of {CPU: 1, node_a: 1}"),
    (["actor.world_size=2", "ray.pools.default.label_selector={zone: 'in(a,b)'}"],
     [_node(1, labels={"zone": "a"}), _node(1, labels={"zone": "b"}), _node(8, labels={"zone": "c"})], None, False, "fits",
     None),
    (["actor.world_size=2", "ray.pools.default.label_selector={zone: '!c'}"],
     [_node(1, labels={"zone": "a"}), _node(8, labels={"zone": "c"})], None, False, "refuse", "room for 1"),
    # every pool fits alone, not all together
    (["actor.world_size=3", "ray.pools={default: {}, gen: {}}", "ray.roles={rollout: gen, reward: gen}"], [_node(3)], None,
     False, "refuse", "the pools together need {CPU: 4} ('default' 3 x {CPU: 1} (actor.world_size=3), 'gen' 1 x "
     "{CPU: 1} (rollout.world_size=1)), more than the cluster has: {CPU: 3, GPU: 0} on 1 live node"),
    # a cluster that lost a node waits for its replacement; beyond what it had, it is refused
    (["actor.world_size=2", "ray.pools.default.strategy=STRICT_SPREAD"], [_node(4), _node(4, alive=False)], None, False,
     "wait", "room for 1 since it lost 1 node(s): {CPU: 4, GPU: 0} on 1 live node; the pools wait up to 120 s"),
    (["actor.world_size=3", "ray.pools.default.strategy=STRICT_SPREAD"], [_node(4), _node(4, alive=False)], None, False,
     "refuse", "room for 1: {CPU: 4, GPU: 0} on 1 live node"),
    # an autoscaling cluster is refused only beyond its ceiling
    (["actor.layout={data_parallel: 64}"], [_node(2)], {"CPU": 512.0}, False, "wait",
     "its autoscaler may add nodes (up to {CPU: 512}): the pools wait up to 120 s"),
    (["actor.layout={data_parallel: 100000}"], [_node(2)], {"CPU": 512.0}, False, "refuse",
     "and its autoscaler grows it to at most {CPU: 512}"),
    (["actor.layout={data_parallel: 2}"], [_node(2)], None, True, "fits", None),
])
def test_pools_the_cluster_cannot_hold_are_refused_naming_key_need_and_what_it_has(overrides, nodes, ceiling, local,
                                                                                    verdict, says):
    from rlcore.controller.ray_placement import placement_verdict
    from rlcore.trainer.roles import LOCAL_RAY_HINT

    got, why = placement_verdict(_demands(*overrides), nodes, ceiling, local, LOCAL_RAY_HINT if local else "")
    assert got == verdict, why
    assert (why is None) if says is None else (says in why), why
    if verdict == "refuse" and local:
        assert why.endswith("ray.num_cpus gives it more CPUs, ranks then sharing cores; ray.address runs on a cluster)")
