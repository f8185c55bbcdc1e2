"""Where a run's workers go on a Ray cluster: resource pools (placement groups of equal bundles)
and the check, before any pool is made, that the cluster can hold them all.

A `ResourcePool` is a placement group of `n` bundles; rank r of every group on the pool runs on
bundle r. A pool's strategy spreads its bundles over a cluster's nodes, and its custom resources
and label selector pick which nodes (`ray.pools.*`). `check_placement` refuses pools the cluster
can never hold (naming the key, what they need and what the cluster has) and says at once when
they must wait for nodes to join.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from rlcore.controller.ray_cluster import describe_nodes
from rlcore.errors import RLCoreError

__all__ = [
    "POOL_TIMEOUT_S",
    "PlacementError",
    "PoolDemand",
    "ResourcePool",
    "bundle_of",
    "check_placement",
    "cluster_totals",
    "placement_shortfall",
    "placement_verdict",
]

log = logging.getLogger(__name__)


def bundle_of(cpus: float, gpus: float = 0.0, resources: dict[str, float] | None = None) -> dict[str, float]:
    """One bundle of a pool as Ray reserves it: CPUs, GPUs when any, and the pool's custom resources."""
    bundle = {"CPU": float(cpus), **{k: float(v) for k, v in (resources or {}).items()}}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


POOL_TIMEOUT_S = 120.0  # how long a pool waits for its bundles (nodes joining: an autoscaler, a replacement)


class ResourcePool:
    """A placement group of `bundles` equal bundles; rank r of each group on it uses bundle r."""

    def __init__(self, name: str, bundles: int, cpus_per_bundle: float = 1.0, gpus_per_bundle: float = 0.0,
                 strategy: str = "PACK", timeout_s: float = POOL_TIMEOUT_S, resources: dict[str, float] | None = None,
                 label_selector: dict[str, str] | None = None):
        """`resources`: custom resources every bundle also reserves (only nodes that have them hold
        the pool); `label_selector`: node labels every bundle's node must match (Ray's syntax)."""
        import ray
        from ray.util.placement_group import placement_group

        if bundles < 1:
            raise ValueError(f"resource pool {name!r}: bundles must be >= 1, got {bundles}")
        self.name, self.bundles = name, bundles
        self.cpus_per_bundle, self.gpus_per_bundle = float(cpus_per_bundle), float(gpus_per_bundle)
        bundle = bundle_of(self.cpus_per_bundle, self.gpus_per_bundle, resources)
        selectors = [dict(label_selector) for _ in range(bundles)] if label_selector else None
        self.pg = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy,
                                  bundle_label_selector=selectors)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            where = f" on nodes labelled {label_selector}" if label_selector else ""
            raise RuntimeError(
                f"resource pool {name!r} (ray.pools.{name}): could not reserve {bundles} x {bundle}{where} "
                f"({strategy}) within {timeout_s:.0f}s; the cluster's live nodes: {describe_nodes()}"
            ) from None

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # already gone with the cluster
            pass

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, bundles={self.bundles}, cpu={self.cpus_per_bundle}, gpu={self.gpus_per_bundle})"


class PlacementError(RLCoreError):
    """The pools of a run can never be placed on the cluster (nothing was started on it)."""


@dataclass(frozen=True)
class PoolDemand:
    """What one resource pool asks of the cluster: `bundles` alike bundles (`bundle_of`), placed by
    `strategy` on nodes matching `label_selector`; `why` names the config key that set the count."""

    name: str
    bundles: int
    bundle: dict[str, float]
    strategy: str = "PACK"
    label_selector: dict[str, str] = field(default_factory=dict)
    why: str = ""


_MANY = 1 << 62  # bundles a node holds when a bundle reserves nothing


def _per_node(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles a node with `resources` holds (Ray counts in units of 1e-4)."""
    counts = [math.floor(resources.get(k, 0.0) / v + 1e-6) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else _MANY


def _label_matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Ray's label selector semantics: 'v', '!v', 'in(a,b)', '!in(a,b)' per key (an empty
    condition matches every node: it is not refused on a guess)."""
    for key, condition in selector.items():
        negated, body = condition.startswith("!"), condition.lstrip("!")
        if not body:
            continue
        wanted = {v.strip() for v in body[3:-1].split(",")} if body.startswith("in(") and body.endswith(")") else {body}
        if (labels.get(key) in wanted) == negated:
            return False
    return True


def placement_shortfall(demands: list[PoolDemand], nodes: list[dict[str, Any]]) -> str | None:
    """Why `demands` cannot all be placed on `nodes` (`ray.nodes()` entries: `Resources`, `Labels`),
    or None when they can: each pool on the nodes its labels allow, by its strategy, and all pools
    together within the nodes' totals. Necessary conditions, not a full bin packing: a set of
    pools that passes may still wait (fragmentation; other jobs' reservations)."""
    for pool in demands:
        eligible = [n for n in nodes if _label_matches(n.get("Labels") or {}, pool.label_selector)]
        per_node = [_per_node(n.get("Resources") or {}, pool.bundle) for n in eligible]
        if pool.strategy == "STRICT_PACK":
            fits, rule = max(per_node, default=0), "all on one node (STRICT_PACK)"
        elif pool.strategy == "STRICT_SPREAD":
            fits, rule = sum(1 for k in per_node if k >= 1), "each on its own node (STRICT_SPREAD)"
        else:
            fits, rule = sum(per_node), pool.strategy
        if fits < pool.bundles:
            where = f" on nodes labelled {pool.label_selector}" if pool.label_selector else ""
            total = {k: _amount(v * pool.bundles) for k, v in pool.bundle.items() if v > 0}
            room = min(fits, pool.bundles)
            return (f"{pool.why}: pool {pool.name!r} (ray.pools.{pool.name}) needs {pool.bundles} bundles of "
                    f"{_shown_bundle(pool.bundle)}, {rule}{where} ({_shown_bundle(total)} in all), and the cluster has "
                    f"room for {room}")
    need: dict[str, float] = {}
    for pool in demands:
        for k, v in pool.bundle.items():
            need[k] = need.get(k, 0.0) + v * pool.bundles
    have = cluster_totals(nodes)
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-6}
    if short:
        parts = ", ".join(f"{p.name!r} {p.bundles} x {_shown_bundle(p.bundle)} ({p.why})" for p in demands)
        return (f"the pools together need {_shown_bundle({k: _amount(v) for k, v in need.items()})} ({parts}), more "
                f"than the cluster has")
    return None


def cluster_totals(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Every resource of `nodes` summed (`ray.cluster_resources()` for the live nodes)."""
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in (node.get("Resources") or {}).items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _amount(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 4)


def _shown_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in bundle.items()) + "}"


def _shown_cluster(nodes: list[dict[str, Any]], demands: list[PoolDemand]) -> str:
    """What the cluster has of the resources `demands` use, and its nodes."""
    totals = cluster_totals(nodes)
    names = ["CPU", "GPU", *sorted({k for p in demands for k in p.bundle} - {"CPU", "GPU"})]
    labelled = {str(p.label_selector): sum(_label_matches(n.get("Labels") or {}, p.label_selector) for n in nodes)
                for p in demands if p.label_selector}
    nodes_part = f"{len(nodes)} live node{'s' if len(nodes) != 1 else ''}"
    if labelled:
        nodes_part += ", " + ", ".join(f"{n} labelled {sel}" for sel, n in labelled.items())
    return f"{_shown_bundle({k: totals.get(k, 0.0) for k in names})} on {nodes_part}"


def _autoscaler_ceiling() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler may grow it to (what it reported to the
    GCS); None for a cluster without one (a local Ray, `ray start` by hand)."""
    try:
        from ray._private.state import state

        ceiling = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - another Ray layout: judged as a fixed cluster
        return None
    return {k: float(v) for k, v in ceiling.items()} if ceiling else None


def placement_verdict(demands: list[PoolDemand], nodes: list[dict[str, Any]], ceiling: dict[str, float] | None,
                      local: bool, hint: str = "") -> tuple[str, str | None]:
    """("fits", None), ("wait", why) or ("refuse", why) for `demands` on a cluster of `nodes`
    (`ray.nodes()`: live and dead) whose autoscaler grows it to `ceiling` (None: none does).

    Judged against the live nodes. A cluster that can grow is given the chance: one whose
    autoscaler reports a ceiling is refused only beyond that ceiling, and one that lost nodes
    only beyond what it had with them: the pools then wait up to `POOL_TIMEOUT_S` for nodes to
    join. A local Ray (`local`) never grows."""
    alive = [n for n in nodes if n.get("Alive")]
    shortfall = placement_shortfall(demands, alive)
    if shortfall is None:
        return "fits", None
    has = _shown_cluster(alive, demands)
    if not local and ceiling is not None:
        # the ceiling is a total: pools bound to labels or to node counts are left to the wait
        judged = all(p.strategy in ("PACK", "SPREAD") and not p.label_selector for p in demands)
        if not judged or placement_shortfall(demands, [{"Resources": ceiling}]) is None:
            return "wait", (f"{shortfall} now: {has}; its autoscaler may add nodes (up to {_shown_bundle(ceiling)}): "
                            f"the pools wait up to {POOL_TIMEOUT_S:.0f} s for them")
        return "refuse", f"{shortfall}: {has}, and its autoscaler grows it to at most {_shown_bundle(ceiling)}"
    lost = [n for n in nodes if not n.get("Alive")]
    if not local and lost and placement_shortfall(demands, [*alive, *lost]) is None:
        return "wait", (f"{shortfall} since it lost {len(lost)} node(s): {has}; the pools wait up to "
                        f"{POOL_TIMEOUT_S:.0f} s for replacements")
    return "refuse", f"{shortfall}: {has}{hint}"


def check_placement(demands: list[PoolDemand], local: bool, hint: str = "") -> None:
    """Refuse (PlacementError) pools the connected cluster can never hold, before any is made,
    naming the key, what they need and what the cluster has; say at once when they must wait for
    nodes to join (`placement_verdict`)."""
    import ray

    verdict, why = placement_verdict(demands, ray.nodes(), None if local else _autoscaler_ceiling(), local, hint)
    if verdict == "refuse":
        raise PlacementError(why)
    if verdict == "wait":
        log.warning("%s", why)
