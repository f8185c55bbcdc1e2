"""The rollout section: the generation engine (hf or vLLM), sampling, the agent loop, and how the
engine sleeps and takes the trained weights."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlcore.config.base import Section
from rlcore.config.roles import LayoutConfig, Ranks, layout_fills_rank_keys
from rlcore.rollout_backends import check_backend, support_problem


class VLLMEngineConfig(Section):
    """Engine settings of the `vllm` rollout backend; None picks vLLM's / the backend's default."""

    max_model_len: int | None = Field(None, ge=1, description="default: the model's max_position_embeddings")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step (prefill chunk size)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences decoded at once")
    enforce_eager: bool | None = Field(None, description="default: True on CPU, False (CUDA graphs) on GPU")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: fraction of the card for weights + KV cache")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV cache size; default 1 GiB on CPU, from gpu_memory_utilization on GPU")
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool | None = Field(None, description="default: on for GPU (sleep/wake free memory), off on CPU (unsupported)")
    block_size: int | None = Field(None, ge=1, description="KV cache block (tokens); default 32 on CPU (short RL contexts), vLLM's own on GPU")
    weight_bucket_mb: float = Field(256.0, gt=0, description="max size of one reload_weights call during a weight sync")
    extra: dict[str, Any] = Field(default_factory=dict, description="passed verbatim to vllm.LLM(...)")


class AgentConfig(Section):
    """Multi-turn agent rollouts (`rlcore.rollout.agent`): on when `tools` or `interaction` is set.
    The model calls tools in the hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
    and reads their results as `tool` messages rendered by the chat template; tool outputs and
    template tokens are attended to but masked out of the loss. `rollout.max_new_tokens` caps each
    assistant turn."""

    tools: list[str] = Field([], description="tool functions, 'module:function' or 'path/to/file.py:function', each "
                             "with an OpenAI-style JSON schema (its tool_schema attribute, or read from its type hints "
                             "and docstring); run in sandboxed worker processes")
    interaction: str | None = Field(None, description="'module:Factory' or 'file.py:Factory': called per sample with "
                                    "data_source, ground_truth, extra_info; its respond(messages) answers each assistant "
                                    "turn without a tool call (InteractionReply: content, done, reward)")
    max_turns: int = Field(4, ge=1, description="assistant turns per sample")
    max_total_tokens: int = Field(256, ge=2, description="a sample's whole response: every assistant turn, tool output "
                                  "and template token after the prompt")
    tool_timeout_s: float = Field(10.0, gt=0, description="longest a tool call may run; then it is killed and the model "
                                  "reads a timeout error")
    tool_memory_mb: float | None = Field(1024.0, gt=0, description="memory a tool call may allocate (RLIMIT_AS over what "
                                         "the loaded tools use); beyond it the call fails with MemoryError. None: no limit")
    tool_workers: int = Field(2, ge=1, description="tool worker processes per rollout rank (calls run in parallel)")
    tool_max_chars: int = Field(2000, ge=1, description="a longer tool result is cut to this many characters")

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.interaction is not None

    @model_validator(mode="after")
    def _check_used(self) -> AgentConfig:
        """A setting that would change nothing is refused (compared with the defaults, so a dumped
        config.yaml of a run without agent loads again)."""
        changed = sorted(k for k, f in type(self).model_fields.items() if getattr(self, k) != f.get_default(call_default_factory=True))
        if not self.enabled:
            if changed:
                raise ValueError(f"{changed[0]} is set, but the agent loop is off: set rollout.agent.tools or "
                                 "rollout.agent.interaction")
        elif not self.tools:
            tool_keys = [k for k in changed if k.startswith("tool_")]
            if tool_keys:
                raise ValueError(f"{tool_keys[0]} is set, but rollout.agent.tools is empty")
        return self


class RolloutConfig(Section):
    backend: str = Field("auto", description="a rollout backend (rlcore.rollout_backends): hf, vllm, one registered with "
                         "rlcore.rollout.register_backend, or 'module:Class' of an engine class. auto: vllm where "
                         "installed, else hf")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="rollout engine dtype; default model.dtype. bfloat16 is what GPU rollouts run (and is ~1.7x "
        "faster on AMX CPUs); the actor still recomputes log-probs in model.dtype, rollout/logprob_diff_* shows the gap "
        "and actor.tis_cap corrects for it")
    world_size: Ranks = Field(1, description="rollout engines (data parallel; Ray backend); set by rollout.layout "
                            "when that is given (its data_parallel)")
    layout: LayoutConfig | None = Field(
        None, description="data_parallel: rollout engines (Ray workers), each serving a share of the prompts; "
        "tensor_parallel: ranks of each vLLM engine (vLLM's tensor_parallel_size; on CPU each engine rank gets its "
        "worker's cores as VLLM_CPU_OMP_THREADS_BIND). sequence_parallel must be 1. Default: world_size engines, "
        "tensor_parallel 1")
    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_new_tokens: int = Field(32, ge=1)
    val_n: int = Field(1, ge=1, description="samples per validation prompt; > 1 reports mean@n, pass@n and maj@n per data_source")
    val_temperature: float = Field(1.0, gt=0)
    val_greedy: bool | None = Field(None, description="default: greedy when val_n is 1, sampled when val_n > 1")
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    agent: AgentConfig = AgentConfig()
    lora_sync: Literal["auto", "merged", "adapter"] = Field(
        "auto", description="with actor.lora: how the trained weights reach the engine. merged: the merged weights "
        "of the adapted modules only (the rest never changes); adapter: the adapter itself, which vLLM applies per "
        "request (vllm backend only). auto: merged")
    sleep: Literal["auto", "always", "never"] = Field(
        "auto", description="the engine sleeps (its weights and KV cache off the GPU) from after generation until the "
        "weight sync. auto: only where it shares a GPU with the actor (in-process on CUDA, or one GPU pool on Ray) and "
        "the update would not fit beside it: the first step sleeps and measures the update's peak, later steps keep "
        "the engine awake when that peak, the engine and a 10% margin fit the device (logged once, with the numbers). "
        "always / never force it (on a CPU sleeping is a no-op). Older spelling: free_memory_when_idle (true: always, "
        "false: never)")

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        return layout_fills_rank_keys(data, "rollout", None, engines=True)

    @model_validator(mode="after")
    def _check_layout(self) -> RolloutConfig:
        if self.layout is not None and self.layout.sequence_parallel != 1:
            raise ValueError(f"rollout.layout.sequence_parallel={self.layout.sequence_parallel}: rollout engines split "
                             "a model by tensor parallelism only (rollout.layout.tensor_parallel)")
        problem = None if self.backend == "auto" else support_problem(self.backend, self.tensor_parallel_size, "full")
        if problem is not None:  # auto: the rollout worker checks what it resolves to
            raise ValueError(problem)
        return self

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        return check_backend(name)

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks of each rollout engine (vLLM's tensor_parallel_size)."""
        return 1 if self.layout is None else self.layout.tensor_parallel

