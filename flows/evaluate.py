"""`evaluate` for prefect.yaml's entrypoint `flows/evaluate.py:evaluate`: the flow itself lives in the
installed package (rlcore.flows.evaluate), so that a wheel carries it; this is the Prefect project's
view of it in the repository."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a worker that runs this file in the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlcore.flows.evaluate import evaluate, evaluate_task

__all__ = ["evaluate", "evaluate_task"]
