"""`rlcore plan`: per-rank memory of every role of a run at each layout, simulated before any
device is booked (the meta device, torch's fake process group, fake tensors), and the smallest
layouts that fit. See `planner` for the search, `simulate` for one simulated step, `rollout` for
the rollout's arithmetic, `torch_api` for the private torch APIs it stands on.

The planner's names are imported on first use: `hardware` needs no torch, so `rlcore plan`
refuses a bad hardware argument (and the run's config) before torch loads."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.plan.hardware import Hardware, PlanInputError, parse_fraction, parse_size
    from rlcore.plan.planner import PlanReport, plan_run
    from rlcore.plan.report import render

_EXPORTS = {"Hardware": "hardware", "PlanInputError": "hardware", "parse_fraction": "hardware", "parse_size": "hardware",
            "PlanReport": "planner", "plan_run": "planner", "render": "report"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlcore.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlcore.plan.{_EXPORTS[name]}"), name)


__all__ = ["Hardware", "PlanInputError", "PlanReport", "parse_fraction", "parse_size", "plan_run", "render"]
