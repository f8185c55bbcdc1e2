"""Fast checks for what the Ray backend adds outside Ray: config fields and their errors, the
COLLECTIVE dispatch, `wg.method_async`, and futures passed as arguments (in-process backend)."""

from __future__ import annotations

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
    from rlcore.controller.ray_backend import ensure_ray

    # a dashboard URL in RAY_ADDRESS (as `ray job submit` users set it) is refused, naming the key
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(ValueError, match="is a dashboard \\(job server\\) URL; ray.address"):
        ensure_ray()


def test_colocated_roles_become_one_unit_and_must_share_world_size():
    cfg = _load("trainer.backend=ray", "actor.world_size=2", "ray.colocate=[[actor, rollout]]")
    roles = {"actor": (None, 2), "rollout": (None, 1), "reward": (None, 1)}
    with pytest.raises(ValueError, match="different world sizes"):
        _units(cfg, roles)
    roles["rollout"] = (None, 2)
    assert _units(cfg, roles) == [["actor", "rollout"], ["reward"]]


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
