"""The model lifecycle behind the Prefect flows in `flows/`, as plain functions: data prep and
dataset fingerprints, the run-health guard, held-out evaluation, the promotion gate, the MLflow
registry, lineage records and webhook notifications. Importing this package imports neither
Prefect nor MLflow (modules that need them import them when called), and its names below load on
first use: `rlcore pipeline emit` imports only `rlcore.lifecycle.events`, not torch (health) and
pyarrow (data prep)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.lifecycle.data_prep import PreparedData, dedup_key, prepare_dataset
    from rlcore.lifecycle.fingerprint import files_fingerprint, rows_fingerprint
    from rlcore.lifecycle.gate import Decision, GatePolicy, decide
    from rlcore.lifecycle.health import HealthBreach, HealthGuard
    from rlcore.lifecycle.notify import notify

_HOME = {
    "PreparedData": "data_prep", "dedup_key": "data_prep", "prepare_dataset": "data_prep",
    "files_fingerprint": "fingerprint", "rows_fingerprint": "fingerprint",
    "Decision": "gate", "GatePolicy": "gate", "decide": "gate",
    "HealthBreach": "health", "HealthGuard": "health",
    "notify": "notify",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"rlcore.lifecycle.{_HOME[name]}"), name)
    raise AttributeError(f"module 'rlcore.lifecycle' has no attribute {name!r}")


__all__ = [
    "Decision", "GatePolicy", "HealthBreach", "HealthGuard", "PreparedData", "decide", "dedup_key",
    "files_fingerprint", "notify", "prepare_dataset", "rows_fingerprint",
]
