"""What a weight sync taken between two decode steps costs a generation (`trainer.async_weight_sync=step`),
on the vLLM and the hf engine, against the same generation without one.

    ./dev python benchmarks/bench_decode_switch.py [--prompts 32 --n 4 --new-tokens 64 --at 32 --repeats 3]
        [--backends vllm,hf]

The model is bench_rollout's random Llama (no EOS: every row decodes `--new-tokens` tokens). Each
round generates once without a sync and once with the full state dict of a second model loaded at
decode step `--at` (the switch runs the sync on the generating thread, as the async rollout's gate
does). Reported, median over `--repeats` rounds after a warm-up: the generation's wall time without
and with the sync, the sync itself (the time the generation stands still for it), and what is left
of the difference: resuming the sequences on the new weights (vLLM preempts every request and
recomputes its prefix; hf recomputes the KV cache of the rows still decoding). For vLLM also its own
count: the first engine step after the sync against a median decode step (`SwitchCost`).
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_rollout import make_model  # benchmarks/ is the script's folder


class SyncAt:
    """A `WeightSwitch` that loads `weights` into `engine` at decode-step boundary `at`, on the
    generating thread, and times it."""

    def __init__(self, engine: Any, weights: dict[str, torch.Tensor], at: int) -> None:
        self.engine, self.weights, self.at = engine, weights, at
        self.calls, self._version, self.sync_s = 0, 0, 0.0

    def version(self) -> int:
        return self._version

    def between_steps(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        began = time.perf_counter()
        with torch.inference_mode(False):  # as the async rollout's `DecodeSwitch` runs it
            self.engine.update_weights(self.weights.items())
        self.sync_s = time.perf_counter() - began
        self._version += 1
        return True


def prompts(count: int, length: int = 16) -> Any:
    from rlcore.protocol import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (count, length), generator=g)
    return Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def measure(name: str, engine: Any, weights: list[dict[str, torch.Tensor]], args: argparse.Namespace) -> dict[str, float]:
    from rlcore.rollout import SamplingParams

    batch = prompts(args.prompts)
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, seed=0)
    engine.generate(batch, params)  # warm-up
    rows: dict[str, list[float]] = {k: [] for k in ("plain_s", "switched_s", "sync_s", "resume_s", "engine_resume_s",
                                                    "engine_step_s")}
    for r in range(args.repeats):
        engine.weight_switch = None
        began = time.perf_counter()
        engine.generate(batch, params)
        rows["plain_s"].append(time.perf_counter() - began)
        engine.weight_switch = switch = SyncAt(engine, weights[(r + 1) % 2], args.at)
        began = time.perf_counter()
        out = engine.generate(batch, params)
        rows["switched_s"].append(time.perf_counter() - began)
        engine.weight_switch = None
        assert switch.calls >= args.at and int(out["token_versions"].max()) == 1, "the sync was not taken mid-generation"
        rows["sync_s"].append(switch.sync_s)
        rows["resume_s"].append(rows["switched_s"][-1] - rows["plain_s"][-1] - switch.sync_s)
        cost = getattr(engine, "switch_cost", None)
        if cost is not None:
            rows["engine_resume_s"].append(cost.resume_s)
            rows["engine_step_s"].append(statistics.median(cost.steps_s))
    result = {k: statistics.median(v) for k, v in rows.items() if v}
    print(f"{name:5s} " + "  ".join(f"{k} {v * 1e3:8.1f} ms" for k, v in result.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--at", type=int, default=32, help="the decode-step boundary the sync is taken at")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="vllm,hf")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_a = make_model(Path(tmp) / "a")
        torch.manual_seed(1)
        model_b = type(model_a)(model_a.config)
        weights = [model_a.state_dict(), model_b.state_dict()]
        print(f"{args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens, sync at decode step {args.at} "
              f"({sum(t.numel() * t.element_size() for t in weights[0].values()) / 2**20:.1f} MiB of weights)")
        for backend in args.backends.split(","):
            if backend == "vllm" and importlib.util.find_spec("vllm") is None:
                print("vllm  not installed: skipped")
                continue
            from rlcore.rollout import make_rollout_engine

            extra = {"kv_cache_gib": 0.25, "max_model_len": 256} if backend == "vllm" else {}
            engine = make_rollout_engine(backend, path=str(Path(tmp) / "a"), dtype="float32", device="cpu",
                                         eos_token_ids=[], **extra)
            try:
                measure(backend, engine, weights, args)
            finally:
                close = getattr(engine, "close", None)
                if close is not None:
                    close()


if __name__ == "__main__":
    main()
