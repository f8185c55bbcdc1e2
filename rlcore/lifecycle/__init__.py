"""The model lifecycle behind the Prefect flows in `flows/`, as plain functions: data prep and
dataset fingerprints, the run-health guard, held-out evaluation, the promotion gate, the MLflow
registry, lineage records and webhook notifications. Importing this package imports neither
Prefect nor MLflow (modules that need them import them when called)."""

from rlcore.lifecycle.data_prep import PreparedData, dedup_key, prepare_dataset
from rlcore.lifecycle.fingerprint import files_fingerprint, rows_fingerprint
from rlcore.lifecycle.gate import Decision, GatePolicy, decide
from rlcore.lifecycle.health import HealthBreach, HealthGuard
from rlcore.lifecycle.notify import notify

__all__ = [
    "Decision", "GatePolicy", "HealthBreach", "HealthGuard", "PreparedData", "decide", "dedup_key",
    "files_fingerprint", "notify", "prepare_dataset", "rows_fingerprint",
]
