"""LoRA on a trained role's model, through `peft`: the adapter applied from the config, turned off
for reference log-probs, its own tensors for checkpoints and the rollout engine, and the merged
weights of the adapted modules for a weight sync.

The worker keeps computing with the transformers model itself: `peft` injects its LoRA layers
into it in place (`get_peft_model(...).get_base_model()` is the same object), so what reads a
transformers model (the backbone by `base_model_prefix`, the head by `get_output_embeddings()`,
FSDP2's per-layer sharding, `check_lm_head`, `check_packed_forward`) reads it as without LoRA. The
`PeftModel` around it is kept for peft's own API: `disable_adapter()`, the adapter's state-dict
names and its config. The input embeddings and the output head are never adapted (refused): the
log-prob path reads the head's weight directly.

`apply_lora` is the one way a role gets its adapter (`actor.lora`, `critic.lora`, ...); a head
that a classifier task trains from scratch (the critic's value head, a reward model's score) is
trained in full beside the adapter (peft's `modules_to_save`) and saved with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.config import LoraConfig
from rlcore.rollout.base import reload_group
from rlcore.workers.fsdp import bucket_by_bytes, to_full
from rlcore.workers.tokenizer import copy_tokenizer

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # PeftModel's parameter names = this + the wrapped model's
# The heads a classifier task trains in full (transformers' names), never adapted.
CLASSIFIER_HEADS = ("score", "classifier")
TASKS = {"causal_lm": "CAUSAL_LM", "token_cls": "TOKEN_CLS", "seq_cls": "SEQ_CLS"}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`, a tied tensor counted once; global sizes when
    sharded (a DTensor's `numel()` is its full size)."""
    trainable = total = 0
    for p in model.parameters():  # `parameters()` yields a shared tensor once
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def apply_lora(model: nn.Module, cfg: LoraConfig, key: str, task: str = "causal_lm", seed: int = 0,
               mixed_precision: bool = False) -> Adapter:
    """Inject LoRA adapters (`cfg`) into `model` in place and freeze everything else but a
    classifier head. `key` is the config section (`actor.lora`), named in errors: a target module the
    model lacks, or an adapted embedding or head.

    A is drawn from `seed` (B starts at zero): every process, rank and run starts from the same
    adapter, whatever its torch RNG did before (a Ray worker's is seeded at random), and the
    caller's RNG stream is left as it was.

    `mixed_precision`: the role computes under a precision policy (`shard_model`'s bf16: FSDP2's,
    or `LocalPolicy`'s per-module casts), which hands every layer its compute copy: the adapter then
    takes its input as it comes, instead of peft casting it to the float32 master's dtype first."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    heads = [h for h in CLASSIFIER_HEADS if isinstance(getattr(model, h, None), nn.Module)] if task != "causal_lm" else []
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules, bias="none",
        task_type=TASKS[task], exclude_modules=heads or None,
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise ValueError(f"{key}.target_modules={cfg.target_modules!r}: {err}") from None
    for what, module in (("input embeddings", model.get_input_embeddings()), ("output head", model.get_output_embeddings())):
        if isinstance(module, BaseTunerLayer):
            raise ValueError(f"{key}.target_modules={cfg.target_modules!r} adapts the model's {what}; LoRA on the "
                             "embeddings or the output head is not supported (the log-prob path reads the head's weight)")
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLinear) and name.rsplit(".", 1)[-1] not in heads:
            raise ValueError(f"{key}.target_modules: {name} is a {type(module.get_base_layer()).__name__}; "
                             "LoRA is supported on linear layers only")
    if mixed_precision:
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.cast_input_dtype_enabled = False
    return Adapter(wrapped, key, *parameter_counts(model))


@dataclass(frozen=True)
class Adapter:
    """A role's LoRA adapter: the `PeftModel` around the worker's model, and its parameter counts
    (taken before sharding)."""

    peft: Any  # peft.PeftModel
    key: str
    trainable_params: int
    total_params: int

    @property
    def model(self) -> nn.Module:
        """The model the worker computes with (LoRA layers inside; maybe FSDP-sharded in place)."""
        model: nn.Module = self.peft.get_base_model()
        return model

    def disabled(self) -> Any:
        """Context in which the model is its base: every adapter off (peft's `disable_adapter`)."""
        return self.peft.disable_adapter()

    def metrics(self, role: str) -> dict[str, float]:
        return {f"{role}/trainable_params": float(self.trainable_params), f"{role}/total_params": float(self.total_params)}

    def config_dict(self) -> dict[str, Any]:
        """The adapter's `adapter_config.json` content (target modules resolved, e.g. from all-linear)."""
        cfg = self.peft.peft_config[ADAPTER].to_dict()
        return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))

    # ------------------------------------------------------------------ the adapter's tensors
    def state(self, keep: bool) -> dict[str, torch.Tensor]:
        """The adapter's full tensors (and a trained classifier head) under peft's file names
        (`base_model.model.<module>.lora_A.weight`, ...), on CPU. Sharded: gathered, a collective
        every rank calls; only a rank with `keep` gets them (else {})."""
        from peft import get_peft_model_state_dict

        trained = self._trained_state(keep)
        return get_peft_model_state_dict(self.peft, state_dict=trained) if keep else {}

    def save(self, folder: Path, keep: bool) -> None:
        """The adapter as peft saves one (`adapter_config.json`, `adapter_model.safetensors`): what
        `PeftModel.from_pretrained(base, folder)` and vLLM's `LoRARequest` load. Collective when sharded."""
        trained = self._trained_state(keep)
        if keep:
            self.peft.save_pretrained(str(folder), state_dict=trained)

    def _trained_state(self, keep: bool) -> dict[str, torch.Tensor]:
        """Full CPU tensors of every trained parameter, under the PeftModel's names (gathered when sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        full = get_model_state_dict(self.model, options=options)
        return {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in full.items()} if keep else {}

    def load(self, folder: Path) -> None:
        """Adapter tensors saved by `save` into this (unsharded) model; every one must match."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(folder) / ADAPTER_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no {ADAPTER_WEIGHTS} (not a LoRA adapter folder; {self.key} is set)")
        saved = load_file(str(path))
        result = set_peft_model_state_dict(self.peft, saved)
        missing = [k for k in result.missing_keys if "lora_" in k or ".modules_to_save." in k]
        if result.unexpected_keys or missing or len(saved) != len(self.state(keep=True)):
            raise ValueError(f"{path}: does not fit this model's adapter ({self.key}): unexpected "
                             f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}")

    # ------------------------------------------------------------------ merged weights for a sync
    def sync_plan(self, bucket_bytes: int) -> list[list[str]]:
        """Checkpoint names (the base model's own: `model.layers.0.self_attn.q_proj.weight`) of what a
        weight sync sends, in buckets of about `bucket_bytes`: every tensor of each rollout reload
        group (`reload_group`) that holds an adapted module; nothing else changes. The same on every rank."""
        modules = self._lora_modules()
        groups = {reload_group(f"{name}.weight") for name in modules}
        sizes = [(name, t.numel() * t.element_size()) for name, t in self.base_state().items() if reload_group(name) in groups]
        return bucket_by_bytes(sizes, bucket_bytes)

    def merged_weights(self, names: list[str], keep: bool, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Full tensors of `names` (from `sync_plan`; in host memory unless `on_device`): an adapted module's weight merged,
        W + scaling * B @ A (peft's `Linear.get_delta_weight`; transposed for a fan-in-fan-out
        layer), in one fused `addmm` on the gathered full tensors, so from the float32 masters
        whatever the compute precision; every other tensor as it is (a view when unsharded, as the
        full sync sends). Sharded: every rank calls it with the same names (gathers); only `keep`
        gets the tensors."""
        modules = self._lora_modules()
        state = self.base_state()
        out: list[tuple[str, torch.Tensor]] = []
        for name in names:
            owner, _, leaf = name.rpartition(".")
            tensor = to_full(state[name].detach())
            module = modules.get(owner)
            if module is not None and leaf == "weight":
                a = to_full(module.lora_A[ADAPTER].weight.detach()).float()
                b = to_full(module.lora_B[ADAPTER].weight.detach()).float()
                left, right = (a.T, b.T) if module.fan_in_fan_out else (b, a)
                tensor = torch.addmm(tensor.float(), left, right, alpha=module.scaling[ADAPTER]).to(tensor.dtype)
            if keep:
                out.append((name, tensor if on_device else tensor.cpu()))
        return out

    def _lora_modules(self) -> dict[str, Any]:
        from peft.tuners.lora import Linear as LoraLinear

        return {name: m for name, m in self.model.named_modules() if isinstance(m, LoraLinear)}

    def base_state(self) -> dict[str, torch.Tensor]:
        """The model's state under the base model's names: adapter tensors left out, an adapted
        module's `base_layer.` dropped. Sharded tensors stay sharded."""
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if ".lora_" in name or ".modules_to_save." in name:
                continue
            out[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = t
        return out


@contextmanager
def no_adapter(adapter: Adapter | None) -> Iterator[None]:
    """The adapter off inside (nothing to do without one)."""
    if adapter is None:
        yield
        return
    with adapter.disabled():
        yield


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, task: str = "causal_lm",
                  num_labels: int = 1, pad_token_id: int | None = None) -> Path:
    """A plain Hugging Face folder of base + adapter merged (peft's `merge_and_unload`; a classifier
    task's trained head comes from the adapter folder), with the base's tokenizer and generation
    files: what transformers and vLLM serve as is. `num_labels`: a classifier head's outputs;
    `pad_token_id`: a classifier's pad token, written into its config (where a sequence
    classifier's forward reads the score); default the base config's."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    base_dir = Path(base_dir)
    if task == "causal_lm":
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    else:
        auto = {"token_cls": AutoModelForTokenClassification, "seq_cls": AutoModelForSequenceClassification}[task]
        config = AutoConfig.from_pretrained(base_dir, num_labels=num_labels, local_files_only=True)
        if pad_token_id is not None:
            config.pad_token_id = pad_token_id
        base = auto.from_pretrained(base_dir, config=config, dtype=torch.float32, local_files_only=True)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(base_dir, out)
    return out


__all__ = ["ADAPTER", "Adapter", "apply_lora", "merge_adapter", "no_adapter", "parameter_counts"]
