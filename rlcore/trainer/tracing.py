"""Following a sample through a step: request ids, the worker that did each phase, trace.jsonl.

Cheap by design: ranks are re-derived from each method's dispatch rule (a pure function of the
batch), not reported back by the workers.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import numpy as np

from rlcore.controller import Dispatch, RoleView
from rlcore.controller.dispatch import balanced_partitions
from rlcore.protocol import Batch

log = logging.getLogger(__name__)

# Which role does the work of each timed phase (trace.jsonl names the worker with its timing).
PHASE_ROLES = {
    "generate": "rollout", "rollout_sleep": "rollout", "rollout_wake": "rollout", "reward": "reward",
    "old_log_prob": "actor", "ref_log_prob": "ref", "values": "critic", "advantage": "controller",
    "update_critic": "critic", "update_actor": "actor", "weight_sync": "actor+rollout",
    "baseline_generate": "rollout", "baseline_reward": "reward", "reward_model": "reward_model",
}


def worker_identities(groups: Any) -> dict[str, list[dict[str, Any]]]:
    """role -> [{rank, pid, host}] of the processes doing each role's work (Ray workers report
    their own; in-process roles run here)."""
    out: dict[str, list[dict[str, Any]]] = {}
    here = {"pid": os.getpid(), "host": socket.gethostname()}
    for role in ("actor", "rollout", "reward", "ref", "critic", "reward_model"):
        group = getattr(groups, role, None)
        if group is None:
            continue
        group = group.group if isinstance(group, RoleView) else group
        identities = getattr(group, "identities", None)
        if callable(identities):
            try:
                out[role] = [{"rank": r, **ident} for r, ident in enumerate(identities())]
                continue
            except Exception as e:  # tracing must never stop a run
                log.warning("trace: no worker identities for %s: %s", role, e)
        out[role] = [{"rank": r, **here} for r in range(group.world_size)]
    return out


def sample_records(gen: Batch, groups: Any, n: int) -> list[dict[str, Any]]:
    """Per-sample records of a step: ids from prompt to loss, reward, length, and which
    rollout/actor rank handled the sample (the dispatch is a pure function of the batch); for an
    agent rollout, how it ended and every turn (kind, tool, tokens, latency)."""
    rollout_rank = dp_ranks(groups.rollout, "generate_sequences", len(gen) // max(n, 1), None)
    actor_rank = dp_ranks(groups.actor, "update_actor", len(gen), gen)
    lengths = gen.tensors["response_mask"].sum(-1).long().tolist()
    scores = gen.tensors["scores"].tolist() if "scores" in gen.tensors else [None] * len(gen)
    rm_scores = gen.tensors["rm_scores"].tolist() if "rm_scores" in gen.tensors else None
    meta = gen.meta
    samples = []
    for j in range(len(gen)):
        rec: dict[str, Any] = {
            "uid": _plain(meta["uid"][j]) if "uid" in meta else None,
            "request_id": _plain(meta["request_id"][j]) if "request_id" in meta else None,
            "reward": scores[j],
            "response_length": lengths[j],
        }
        if rm_scores is not None:  # the reward model's raw score (before normalisation and weights)
            rec["rm_score"] = rm_scores[j]
        if rollout_rank is not None:
            rec["rollout_rank"] = int(rollout_rank[j // n])
        for key in ("rollout_pid", "rollout_host", "policy_version"):
            if key in meta:
                rec[key] = _plain(meta[key][j])
        if actor_rank is not None:
            rec["actor_rank"] = int(actor_rank[j])
        if "agent_trace" in meta:  # every turn: assistant turns (tokens, round latency), tool calls, rendered turns
            rec["finish"] = str(meta["agent_finish"][j])
            rec["turns"] = [{k: _plain(v) for k, v in t.items()} for t in meta["agent_trace"][j]]
        samples.append(rec)
    return samples


def step_record(step: int, off_policy: str, step_trace: dict[str, Any] | None, metrics: dict[str, Any],
                workers: dict[str, Any]) -> dict[str, Any]:
    """One trace.jsonl line: phase timings with the role that did them, the workers, the samples."""
    step_trace = step_trace or {}
    phases = step_trace.get("phases") or {k[5:-2]: v for k, v in metrics.items()
                                          if k.startswith("time/") and k.endswith("_s")}
    return {
        "step": step,
        "off_policy": off_policy,
        "phases": {name: {"s": secs, "role": PHASE_ROLES.get(name)} for name, secs in phases.items()},
        "workers": workers,
        "samples": step_trace.get("samples", []),
    }


def _plain(v: Any) -> Any:
    """numpy scalars -> JSON-friendly Python values."""
    return v.item() if isinstance(v, np.generic) else v


def dp_ranks(group: Any, method: str, rows: int, batch: Batch | None) -> np.ndarray | None:
    """Which rank of `group` receives each of `rows` input rows for `method`, re-derived from its
    dispatch (contiguous parts, or token-balanced parts of `batch`); None when not data-parallel."""
    try:
        spec = group.group.methods[f"{group._role}.{method}"] if isinstance(group, RoleView) else group.methods[method]
        ws = group.group.world_size if isinstance(group, RoleView) else group.world_size
    except (AttributeError, KeyError):
        return None
    per_shard = spec.ranks_per_shard  # a sequence-parallel group's ranks share their rows: name its first
    ws //= per_shard
    padded = -(-rows // ws) * ws
    if spec.dispatch is Dispatch.DP_COMPUTE or (spec.dispatch is Dispatch.DP_BALANCED and ws == 1):
        return np.arange(padded)[:rows] // (padded // ws) * per_shard
    if spec.dispatch is Dispatch.DP_BALANCED and batch is not None and "attention_mask" in batch.tensors:
        lengths = batch.tensors["attention_mask"].sum(-1).cpu().numpy().astype(np.int64)
        lengths = np.concatenate([lengths, lengths[np.arange(padded - rows) % rows]])  # as pad_to_multiple
        ranks = np.empty(padded, dtype=np.int64)
        for r, part in enumerate(balanced_partitions(lengths, ws)):
            ranks[part] = r
        return ranks[:rows] * per_shard
    return None
