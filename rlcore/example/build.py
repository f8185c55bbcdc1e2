"""Build the built-in tiny example: tokenizer, data, and an SFT-warmed small Llama.

Everything comes from a seed (no hub, no downloads) and is cached under
`$RLCORE_CACHE/examples/tiny-v<BUILDER_VERSION>-seed<seed>`. A build happens in a temporary
folder renamed into place with `.complete` written last, so an interrupted build is never
mistaken for a finished one and a second call returns at once.

The weights are trained on the machine, so by default the build runs in a child process whose
float code paths do not depend on the CPU (`PINNED_ENV`: ATen's portable kernels, MKL's
SSE2 code branch without approximate reciprocals, one thread): rebuilds on one machine, and on
others with the same CPU, give bit-identical weights whatever kernels the caller would pick, and
the manifest records their sha256. Without the pin, ATen's AVX2 and AVX-512 kernels and MKL's
per-CPU GEMM branches round differently, and the SFT start drifted with the kernels (33.5-34.5%
accuracy; issue #20). The pin does not make CPU models agree: seed 0 gave 055fa45b... on an AMD
EPYC and 902e5497... on an Intel Xeon (same lock, both pinned), so tests check properties of the
machine's own build (tests/test_example_build.py) rather than another machine's hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlcore.chat import prompt_ids
from rlcore.data.io import write_rows
from rlcore.example.evaluate import evaluate_accuracy
from rlcore.example.model import TinyModelSpec, make_model
from rlcore.example.task import format_response, prompt_messages, rl_row, sft_rows, split_problems
from rlcore.example.tokenizer import build_tokenizer
from rlcore.example.warm_start import WarmStartSettings, run_warm_start, save_model
from rlcore.tracking import progress

log = logging.getLogger(__name__)

# Bump whenever anything below changes what gets built (task, tokenizer, model, SFT recipe, the
# float environment of the build).
BUILDER_VERSION = 5
COMPLETE = ".complete"
MANIFEST = "example.json"
WEIGHTS = "model.safetensors"

# The build process's settings, replacing the caller's. Measured on an AVX-512 AMD EPYC, torch
# 2.13 (MKL 2024.2): the ATen kernel set and the MKL branch each changed the trained weights; one
# thread and glibc's libm variants are what MKL's and glibc's reproducibility conditions ask.
PINNED_ENV: dict[str, str] = {
    # ATen's DEFAULT kernels (plain C++ for any x86-64, no FMA contraction) instead of the AVX2 or
    # AVX-512 ones the CPU would pick: those differ in reduction order, FMA use, exp/log
    # approximations and even in how normal_() draws the initial weights.
    "ATEN_CPU_CAPABILITY": "default",
    # MKL's conditional numerical reproducibility on its COMPATIBLE branch (SSE2 without rcpps/
    # rsqrtps): the only branch Intel documents as reproducible on non-Intel CPUs too. float32
    # matmuls go to MKL's sgemm here (torch.__config__: BLAS_INFO=mkl; no oneDNN for float32).
    "MKL_CBWR": "COMPATIBLE",
    # One thread: parallel reductions (ATen, MKL) split work by thread count.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc's libm picks FMA variants of exp/log/pow/sin/cos (double) on CPUs that have FMA, and
    # they round differently now and then (math.cos on 200k arguments: different bits). The
    # training schedule and Adam's bias correction use them. Older glibc spells it *_Usable.
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-FMA,-FMA4,-FMA_Usable,-FMA4_Usable",
    "PYTHONHASHSEED": "0",
}
# MKL's own ISA switches, dropped from the build's environment: MKL_CBWR should rule over them
# (it did here: MKL_ENABLE_INSTRUCTIONS=AVX2 left COMPATIBLE's results as they were), but a build
# must not depend on that.
UNPINNED_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the example, besides the seed."""

    n_train: int = 4000
    n_val: int = 400
    carry_fraction: float = 0.7  # share of train/val problems with a units carry (natural: 0.45)
    drop_carry_prob: float = 0.65  # how often the flawed teacher loses the units carry
    sft_steps: int = 1500
    sft_batch_size: int = 32
    sft_lr: float = 1e-3  # 3e-3 made loss spikes and, on some seeds, no learning at all
    sft_warmup_steps: int = 100
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    eval_n: int = 8  # pass@n reported for the SFT start
    max_new_tokens: int = 10

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Recipe:
        return cls(**{**d, "model": TinyModelSpec(**d["model"])})


@dataclass
class TinyExample:
    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    sft_file: Path
    seed: int
    builder_version: int
    vocab_size: int
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int
    max_prompt_length: int  # longest prompt in the data, in tokens
    max_response_length: int  # longest correct response incl. EOS, in tokens
    sft_greedy_accuracy: float  # validation accuracy of the SFT model, greedy
    sft_sample_accuracy: float  # validation accuracy of single samples at temperature 1
    sft_pass_at_n: float  # pass@n at temperature 1
    eval_n: int
    sft_metrics: dict[str, Any]
    build_time_s: float
    num_threads: int
    weights_sha256: str  # of model/model.safetensors: equal across machines when `pinned`
    pinned: bool  # built under PINNED_ENV (see the module docstring)
    float_env: dict[str, str]  # what decided the floats: torch, ATen kernels, MKL branch, threads

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("root", "model_dir", "train_file", "val_file", "sft_file"):
            d[k] = os.path.relpath(d[k], self.root) if k != "root" else "."
        return d

    @classmethod
    def from_json(cls, root: Path, d: dict[str, Any]) -> TinyExample:
        d = dict(d)
        d["root"] = root
        for k in ("model_dir", "train_file", "val_file", "sft_file"):
            d[k] = root / d[k]
        return cls(**d)


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


def default_example_dir(seed: int) -> Path:
    return default_cache_dir() / "examples" / f"tiny-v{BUILDER_VERSION}-seed{seed}"


def load_tiny_example(out_dir: Path) -> TinyExample | None:
    """The finished example in `out_dir`, or None if there is no complete build of this builder
    version there (an older one is rebuilt, not half-read)."""
    out_dir = Path(out_dir)
    if not (out_dir / COMPLETE).exists():
        return None
    manifest = json.loads((out_dir / MANIFEST).read_text())
    if manifest.get("builder_version") != BUILDER_VERSION:
        return None
    return TinyExample.from_json(out_dir.resolve(), manifest)


def build_tiny_example(out_dir: Path | None = None, seed: int = 0, force: bool = False,
                       recipe: Recipe | None = None, log_fn: Callable[[str], None] | None = None,
                       pinned: bool = True) -> TinyExample:
    """Build (or return the cached) tiny example for `seed`.

    pinned=True builds in a child process under PINNED_ENV (weights identical across x86-64
    machines); pinned=False builds in this process with whatever kernels and threads it has.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_example_dir(seed)
    if not force:
        cached = load_tiny_example(out_dir)
        if cached is not None:
            return cached
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    say = log_fn or log.info
    try:
        if pinned:
            _build_in_pinned_process(tmp, seed, recipe or Recipe(), say)
        else:
            _build_into(tmp, seed, recipe or Recipe(), say, pinned=False)
        (tmp / COMPLETE).write_text("ok\n")  # written last: the build is whole
        if out_dir.exists():
            if not force and load_tiny_example(out_dir) is not None:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return load_tiny_example(out_dir)  # type: ignore[return-value]
            shutil.rmtree(out_dir)  # stale partial build, or force
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_tiny_example(out_dir)  # type: ignore[return-value]


def pinned_env() -> dict[str, str]:
    """This process's environment with the build's float settings pinned."""
    env = {k: v for k, v in os.environ.items() if k not in UNPINNED_ENV}
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this rlcore
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env | PINNED_ENV


def native_env() -> dict[str, str]:
    """This process's environment with one thread (and a fixed hash seed) for a build in a child
    that keeps this CPU's own kernels: reproducible on the machine, not across CPUs."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _build_in_pinned_process(root: Path, seed: int, recipe: Any, say: Callable[[str], None], task: str = "arith",
                             env: dict[str, str] | None = None) -> None:
    """`_build_into` (or the `task`'s builder: `rlcore.example.pinned_build`) in a child under
    PINNED_ENV (ATen picks its kernels once per process, MKL its branch at first use: neither can
    be changed in a process that already ran torch), or under `env`."""
    args = [sys.executable, "-m", "rlcore.example.pinned_build", str(root), str(seed), json.dumps(recipe.to_json()), task]
    with subprocess.Popen(args, env=env or pinned_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        drain.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                say(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:  # interrupted: the build must not outlive its caller
            proc.kill()
            raise
        drain.join()
    if rc != 0:
        raise RuntimeError(f"building the tiny example failed (exit {rc}):\n{''.join(stderr)[-4000:]}")


def enter_pinned_process() -> None:
    """Check this is a process started under PINNED_ENV and settle torch's threads and algorithms."""
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # ATen read the variable at import
        raise RuntimeError(f"ATen runs {torch.backends.cpu.get_cpu_capability()} kernels: not a pinned process")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def build_into_pinned(root: Path, seed: int, recipe: Recipe, say: Callable[[str], None]) -> TinyExample:
    """The build itself, in a process started under PINNED_ENV (`rlcore.example.pinned_build`)."""
    enter_pinned_process()
    return _build_into(root, seed, recipe, say, pinned=True)


def weights_sha256(model_dir: Path) -> str:
    """sha256 of the model's safetensors file (tensors and a fixed header: same weights, same hash)."""
    h = hashlib.sha256()
    with open(Path(model_dir) / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def float_env() -> dict[str, str]:
    """What decides this process's floats besides the weights' recipe: torch (with its MKL), the
    ATen kernel set, the MKL branch, threads, glibc (libm) and its variant mask, the architecture."""
    return {
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"),
        "threads": str(torch.get_num_threads()),
        "libc": " ".join(platform.libc_ver()),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "unset"),
        "machine": platform.machine(),
    }


def save_untrained_model(out_dir: Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """The example's tokenizer and a seeded, untrained tiny Llama in `out_dir` (HF format).

    For tests that need a real model whose behaviour must not hinge on weights trained on the
    machine (the SFT example's near-zero logits and gradients). Returns `out_dir`.
    """
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        model = make_model(tokenizer, spec or TinyModelSpec(), seed)
    save_model(model, tokenizer, out_dir)
    return Path(out_dir)


def _build_into(root: Path, seed: int, recipe: Recipe, say: Callable[[str], None], pinned: bool) -> TinyExample:
    start = time.perf_counter()
    root.mkdir(parents=True)
    tokenizer = build_tokenizer()
    train, val, rest = split_problems(seed, recipe.n_train, recipe.n_val, recipe.carry_fraction)
    train_file = write_rows([rl_row(p, "train", i) for i, p in enumerate(train)], root / "data" / "train.parquet")
    val_file = write_rows([rl_row(p, "val", i) for i, p in enumerate(val)], root / "data" / "val.parquet")
    # SFT draws from every problem except validation ones; each draw asks the flawed teacher anew.
    sft = sft_rows(train + rest, recipe.sft_steps * recipe.sft_batch_size, seed + 1, recipe.drop_carry_prob)
    sft_file = write_rows(sft, root / "data" / "sft.parquet")

    # fork_rng: building the example leaves the caller's torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        model = make_model(tokenizer, recipe.model, seed)
        cfg = WarmStartSettings(lr=recipe.sft_lr, batch_size=recipe.sft_batch_size, micro_batch_size=recipe.sft_batch_size,
                                epochs=1, max_steps=recipe.sft_steps, warmup_steps=recipe.sft_warmup_steps, seed=seed,
                                log_every=250)
        say(f"tiny example: SFT of a {sum(p.numel() for p in model.parameters()):,}-parameter Llama "
            f"for {recipe.sft_steps} steps")
        with progress(recipe.sft_steps, "tiny example SFT", unit="steps", say=say, every_s=10.0) as bar:
            metrics = run_warm_start(model, tokenizer, sft, cfg, log=say, on_step=lambda step, total: bar.update(1))
        model_dir = root / "model"
        save_model(model, tokenizer, model_dir)
        greedy = evaluate_accuracy(model, tokenizer, val_file, greedy=True, max_new_tokens=recipe.max_new_tokens)
        sampled = evaluate_accuracy(model, tokenizer, val_file, greedy=False, n=recipe.eval_n, temperature=1.0,
                                    max_new_tokens=recipe.max_new_tokens, seed=seed)

    all_probs = train + val
    max_prompt = max(len(prompt_ids(prompt_messages(p), tokenizer)[1]) for p in all_probs)
    max_resp = max(len(tokenizer(format_response(p.answer), add_special_tokens=False)["input_ids"]) + 1 for p in all_probs)
    example = TinyExample(
        root=root.resolve(), model_dir=model_dir.resolve(), train_file=train_file.resolve(),
        val_file=val_file.resolve(), sft_file=sft_file.resolve(), seed=seed, builder_version=BUILDER_VERSION,
        vocab_size=model.config.vocab_size, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        max_prompt_length=max_prompt, max_response_length=max_resp,
        sft_greedy_accuracy=greedy["accuracy"], sft_sample_accuracy=sampled["accuracy"],
        sft_pass_at_n=sampled[f"pass@{recipe.eval_n}"], eval_n=recipe.eval_n,
        sft_metrics={k: v for k, v in metrics.items() if k != "losses"},
        build_time_s=time.perf_counter() - start, num_threads=torch.get_num_threads(),
        weights_sha256=weights_sha256(model_dir), pinned=pinned, float_env=float_env(),
    )
    (root / MANIFEST).write_text(json.dumps(example.to_json(), indent=1) + "\n")
    say(f"tiny example built in {example.build_time_s:.0f}s: SFT greedy val acc {greedy['accuracy']:.3f}, "
        f"pass@{recipe.eval_n} {example.sft_pass_at_n:.3f}")
    say(f"tiny example weights sha256 {example.weights_sha256} "
        f"({'pinned: the same whatever kernels this CPU offers' if pinned else 'not pinned: these kernels only'})")
    return example
