"""README's `rlcore plan` table: GRPO on a Llama-3-70B-shaped model (rlcore/configs/llama3_70b, its
config.json alone) on 16 and 64 devices of 80 GiB, with and without activation checkpointing.

Every number is simulated (fake tensors on torch's fake process group, `rlcore.plan`), not
measured. Prints a markdown table, then the CPU and wall seconds it took.

    ./dev python benchmarks/plan_table.py            # the table (CPU minutes per row)
    ./dev python benchmarks/plan_table.py --hardware 2x8 --checkpointing on   # one row
    ./dev python benchmarks/plan_table.py --exact    # every layer simulated (slower; checks the extrapolation)

Each row is printed (to stderr, with its CPU and wall seconds) as soon as it is planned.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "rlcore" / "configs" / "plan_llama3_70b_grpo.yaml"
HARDWARE = [(2, 8), (8, 8)]  # nodes x devices per node


def _cpu_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--memory", default="80GiB")
    parser.add_argument("--hardware", action="append", help="NODESxDEVICES (repeatable; default 2x8 and 8x8)")
    parser.add_argument("--checkpointing", action="append", choices=["on", "off"], help="repeatable; default both")
    args = parser.parse_args()
    hardware_list = [tuple(int(x) for x in h.split("x")) for h in args.hardware] if args.hardware else HARDWARE
    checkpointing_list = [c == "on" for c in args.checkpointing] if args.checkpointing else [True, False]
    os.chdir(ROOT)  # the config's model.path is relative to the repository root
    from rlcore.config import load_config
    from rlcore.plan import Hardware, parse_size, plan_run
    from rlcore.plan.hardware import gib

    started, cpu0 = time.monotonic(), _cpu_seconds()
    rows = []
    for checkpointing in checkpointing_list:
        config = load_config(CONFIG, [f"model.gradient_checkpointing={str(checkpointing).lower()}"])
        for nodes, per_node in hardware_list:
            row_started, row_cpu = time.monotonic(), _cpu_seconds()
            hardware = Hardware(nodes, per_node, parse_size(args.memory))
            report = plan_run(config, hardware, exact=args.exact, progress=lambda line: print(line, file=sys.stderr, flush=True))
            cells = []
            for result in report.roles:
                full = [t for t in result.tried if t.layout.devices == hardware.devices]
                best = min(full, key=lambda t: t.peak.total)
                cell = f"{gib(best.peak.total)} ({best.layout})"
                cell += f"; smallest fit {result.smallest.layout}" if result.smallest else "; fits nowhere"
                cells.append(cell)
            best_rollout = report.rollout.smallest if report.rollout else None
            cells.append(f"TP {best_rollout.tp}: {gib(best_rollout.total)}" if best_rollout else "none")
            c = report.colocated
            cells.append(f"{gib(c.peak[1])} ({c.peak[0]}): {'fits' if c.peak[1] <= hardware.usable else 'no'}" if c else "n/a")
            rows.append((f"{nodes} x {per_node}", "on" if checkpointing else "off", *cells))
            print(f"row {'| ' + ' | '.join(rows[-1]) + ' |'} ({_cpu_seconds() - row_cpu:.0f} CPU s, "
                  f"{time.monotonic() - row_started:.0f} s wall)", file=sys.stderr, flush=True)
    roles = [r.role.role for r in report.roles]
    print(f"| devices | checkpointing | {' | '.join(f'{r}: lowest peak per rank on all devices; smallest fit' for r in roles)} "
          "| rollout: smallest TP, weights + KV per device | all roles colocated: peak per device |")
    print("|" + "---|" * (4 + len(roles)))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{_cpu_seconds() - cpu0:.0f} CPU s, {time.monotonic() - started:.0f} s wall ({'every layer' if args.exact else 'extrapolated'})")


if __name__ == "__main__":
    main()
