"""`train` for prefect.yaml's entrypoint `flows/train.py:train`: the flow itself lives in the
installed package (rlcore.flows.train), so that a wheel carries it; this is the Prefect project's
view of it in the repository."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a worker that runs this file in the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlcore.flows.train import champion_task, train, train_task

__all__ = ["train", "train_task", "champion_task"]
