"""The model and data sections: which model every role loads, how, and the prompts it trains on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlcore.config.base import Section


class ModelConfig(Section):
    path: str = Field(description="local Hugging Face model directory (no hub access)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of every model: actor, reference, critic and (by default) the rollout "
        "engine. bfloat16: the trained roles (actor, critic) still keep float32 master weights, gradients and AdamW "
        "state and compute in bf16 (FSDP2-style mixed precision), unless model.pure_bf16")
    pure_bf16: bool = Field(
        False, description="with dtype bfloat16: train the bf16 weights themselves (AdamW state in bf16, no float32 "
        "master copy). Half the memory of the trained roles, but updates below bf16's resolution (~0.4% of a "
        "weight) are rounded away")
    gradient_checkpointing: bool = Field(
        False, description="actor and critic keep only each decoder layer's input in the forward and recompute the "
        "layer in the backward: activation memory of one layer instead of all, for about one more forward")
    use_remove_padding: bool = Field(
        True, description="actor, reference and critic run each micro-batch as its sequences packed into one row "
        "without pad tokens (per-sequence positions, packed-sequence attention: flash-attn varlen on CUDA when "
        "installed, causal SDPA per sequence otherwise), so the tokens computed are the real ones. false: the "
        "padded [rows, batch-wide prompt + response] forward. A model whose outputs packing would change is "
        "refused at load")
    share_prompt_prefix: bool | None = Field(
        None, description="null (default): on wherever use_remove_padding packs rows; true/false: asked for. "
        "With packing: rows of a micro-batch whose prompts are the same tokens (the "
        "rollout.n samples of a prompt, DPO's chosen and rejected) hold the prompt once in the packed row, their "
        "responses attending to it, so its forward and backward run once, not once per row; the results are the "
        "unshared ones (float tolerance). Not on the flash-attn path (CUDA bf16/fp16 with flash-attn installed), "
        "which runs every row whole. Token-budget micro-batches keep a prompt's rows together")

    @model_validator(mode="after")
    def _check_pure_bf16(self) -> ModelConfig:
        if self.pure_bf16 and self.dtype != "bfloat16":
            raise ValueError(f"model.pure_bf16=true needs model.dtype=bfloat16 (got {self.dtype})")
        if self.share_prompt_prefix and not self.use_remove_padding:
            raise ValueError("model.share_prompt_prefix=true needs model.use_remove_padding=true (prompts are shared "
                             "within a packed row)")
        return self

    @property
    def shares_prompts(self) -> bool:
        """Whether packed rows hold a prompt once for all its rows (`share_prompt_prefix` on packed rows)."""
        return self.use_remove_padding and self.share_prompt_prefix is not False


class DataConfig(Section):
    train_files: list[str]
    val_files: list[str] = []
    max_prompt_length: int = Field(64, ge=1)
    train_batch_size: int = Field(32, ge=1, description="prompts per training step")
    val_batch_size: int = Field(256, ge=1)
    shuffle: bool = True
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"
    tokenizer_check_rows: int = Field(
        32, ge=0, description="prompts per data file whose ids rlcore, the serving side (vLLM's tokenizer for a vLLM "
        "rollout, else AutoTokenizer) and the folder's tokenizer.json must agree on at start-up; 0: no check")
