"""The served deployment of `rl_pipeline` (cron schedule, data-event trigger, server-side failure
notifications); it lives in the installed package (rlcore.flows.serve), which
`rlcore pipeline serve` uses. `prefect.yaml` at the repository root declares the same
deployment for `prefect deploy`."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # run from the repository without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlcore.flows.serve import DEFAULT_CRON, DEPLOYMENT_NAME, build_deployment, data_trigger, serve_pipeline

__all__ = ["DEFAULT_CRON", "DEPLOYMENT_NAME", "build_deployment", "data_trigger", "serve_pipeline"]
