"""Rollout with a plain transformers model and our own KV-cache decoding loop (CPU or GPU).

Why not `model.generate`: we need the log-prob of every sampled token under exactly the
distribution it was drawn from (see `rlcore.rollout.sampling`), and full control over batching.
The loop is: one prefill forward over the left-padded prompts (position ids counted from the
first real token, padding masked), the KV cache repeated `n` times, then one token per step for
all prompts x n at once. Rows that emitted an EOS stop: they get pad tokens and mask 0, and are
dropped from the cache once enough of them piled up, so long stragglers do not pay for
finished rows. The loop stops as soon as every row is finished.

With a `WeightSwitch` set (`trainer.async_weight_sync=step`), new weights may arrive between two
decode steps: the loop asks the switch at every step boundary, and when the weights changed it
recomputes the KV cache of the rows still decoding (prompt plus the tokens so far) with the new
weights, so every later token, and its log-prob, is exactly the new policy's given its prefix (a
kept cache would mix old keys and values with new weights: a policy neither version is). Each
token's policy version is returned beside it (`token_versions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams, WeightSwitch
from rlcore.rollout.decode_attention import use_decode_attention
from rlcore.rollout.kv_cache import make_decode_cache
from rlcore.rollout.output import TOKEN_VERSIONS, check_left_padded, left_pad, rollout_output
from rlcore.rollout.sampling import choose_tokens, keyed_uniforms
from rlcore.rollout_backends import HF, BackendTraits

if TYPE_CHECKING:
    from rlcore.config import RolloutConfig

# Drop finished rows from the KV cache once they are at least this fraction of the rows still
# being decoded: compacting copies the cache, so doing it on every single finish costs more than
# it saves on small batches.
_COMPACT_FRACTION = 0.25



class HFRolloutEngine:
    """`RolloutEngine` over a transformers causal LM. See the module docstring for the loop."""

    traits: ClassVar[BackendTraits] = HF  # its row in `rlcore.rollout_backends`

    @classmethod
    def engine_kwargs(cls, rollout: RolloutConfig, *, seed: int, lora_sync: str, lora_rank: int) -> dict[str, Any]:
        """Keywords of `from_pretrained` from the run's settings beyond the model, dtype, device and end
        tokens every engine takes: none (sampling is keyed per request, the decode loop has no settings)."""
        return {}

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_ids: list[int],
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        self._asleep = False
        self._targets: dict[str, torch.Tensor] | None = None  # `_named_targets`, until sleep or wake moves the model
        self.weight_switch: WeightSwitch | None = None  # new weights between decode steps (`generate` only)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        pad_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        **model_kwargs: Any,
    ) -> HFRolloutEngine:
        """Load a local HF checkpoint; EOS and pad ids come from its generation config / config.

        Without a pad id anywhere, the first EOS id is used as pad (pad positions are masked,
        so the id only has to be a valid token).
        """
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **model_kwargs)
        gen_cfg = getattr(model, "generation_config", None)
        if eos_token_ids is None:
            eos = getattr(gen_cfg, "eos_token_id", None)
            if eos is None:
                eos = model.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if pad_token_id is None:
            pad_token_id = getattr(gen_cfg, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = getattr(model.config, "pad_token_id", None)
            if pad_token_id is None:
                if not eos_token_ids:
                    raise ValueError(f"{path}: config has neither pad_token_id nor eos_token_id; pass pad_token_id")
                pad_token_id = eos_token_ids[0]
        use_decode_attention(model)  # its own model: SDPA without repeating KV heads for each decoded token
        return cls(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, device=device)

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; returns the rollout output batch.

        `rollout_log_probs` are log_softmax(logits / temperature) at the chosen tokens, before
        top-k/top-p filtering (temperature 1 for greedy: `params.logprob_temperature`, which the
        actor recomputes log-probs at).
        """
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.generate called while asleep; call wake() first")
        prompt_ids = batch.tensors["input_ids"]
        prompt_mask = batch.tensors["attention_mask"]
        check_left_padded(prompt_mask)

        responses, response_mask, log_probs, versions = self._decode(
            prompt_ids.to(self.device), prompt_mask.to(self.device), params, switch=self.weight_switch
        )
        out = rollout_output(batch, responses, response_mask, log_probs, params)
        if versions is not None:
            out.tensors[TOKEN_VERSIONS] = versions.to(out.tensors["responses"].device)
        return out

    @torch.inference_mode()
    def generate_turns(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_tokens: Sequence[int], keys: Sequence[int]
    ) -> list[tuple[list[int], list[float]]]:
        """One turn for each context (token ids, continued as they are): (new ids, their log-probs),
        at most `max_tokens[i]` of them, stopping after an end token. The agent loop's primitive.

        Sampled draws are keyed by (`params.seed`, `keys[i]`, token position), so a context's turn
        does not depend on which other contexts share its batch (`rlcore.rollout.sampling`).
        """
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.generate_turns called while asleep; call wake() first")
        if not contexts:
            return []
        ids, mask = left_pad(contexts, self.pad_token_id)
        limits = torch.tensor(list(max_tokens), dtype=torch.long, device=self.device)
        one = replace(params, n=1, max_new_tokens=int(limits.max()))
        tokens, response_mask, log_probs, _ = self._decode(
            ids.to(self.device), mask.to(self.device), one, limits=limits,
            keys=torch.tensor(list(keys), dtype=torch.long, device=self.device))
        lengths = response_mask.sum(-1).long().tolist()
        return [(tokens[i, :k].tolist(), log_probs[i, :k].tolist()) for i, k in enumerate(lengths)]

    def _decode(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
        limits: torch.Tensor | None = None, keys: torch.Tensor | None = None, switch: WeightSwitch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decoding loop. Returns (responses [N,R] long, mask [N,R] float, log-probs [N,R] float32,
        each token's policy version [N,R] long: with a `switch` only, else None).

        `limits` [N]: a row stops after that many tokens (`params.max_new_tokens` caps them all);
        `keys` [N] (with n=1): keyed draws instead of the seeded generator's stream; `switch`: new
        weights may arrive between two steps (the module docstring).
        """
        n, max_new = params.n, params.max_new_tokens
        num_rows = prompt_ids.shape[0] * n
        dev = self.device
        generator = None
        if params.seed is not None and params.do_sample and keys is None:
            generator = torch.Generator(device=dev).manual_seed(params.seed)
        context_lens = prompt_mask.long().sum(-1)

        # Prefill the distinct prompts once, then repeat the cache for the n samples.
        mask = prompt_mask.long()
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = make_decode_cache(self.model.config, capacity=prompt_ids.shape[1] + max_new)
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        next_pos = positions[:, -1] + 1
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)

        tokens = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=dev)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=dev)
        # Rows still in the cache (indices into the N outputs) and which of them have finished.
        rows = torch.arange(num_rows, device=dev)
        done = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        # Attention mask of the rows in the cache: prompt, then one 1 per generated token.
        attn = torch.cat([mask, mask.new_ones(num_rows, max_new)], dim=1)
        prompt_len = prompt_ids.shape[1]
        versions = None if switch is None else torch.zeros(num_rows, max_new, dtype=torch.long, device=dev)
        version = 0 if switch is None else switch.version()  # of the weights the current logits came from

        for step in range(max_new):
            uniforms = None
            if keys is not None and params.do_sample:  # the draw at this row's absolute position
                uniforms = keyed_uniforms(params.seed or 0, keys[rows], context_lens[rows] + step)
            tok, lp = choose_tokens(logits, params, generator, uniforms)
            live = ~done
            live_rows = rows[live]
            tokens[live_rows, step] = tok[live]
            log_probs[live_rows, step] = lp[live]
            lengths[live_rows] = step + 1
            if versions is not None:
                versions[live_rows, step] = version
            done = done | torch.isin(tok, self._eos)
            if limits is not None:
                done = done | (limits[rows] <= step + 1)
            num_done = int(done.sum())
            if num_done == rows.shape[0] or step == max_new - 1:
                break
            if num_done >= max(1, int(_COMPACT_FRACTION * rows.shape[0])):
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tok, next_pos, attn = rows[keep], tok[keep], next_pos[keep], attn[keep]
                done = done[keep]
            if switch is not None and switch.between_steps():
                version = switch.version()
                prefix = torch.cat([prompt_ids.repeat_interleave(n, dim=0)[rows], tokens[rows, : step + 1]], dim=1)
                cache, logits = self._prefill_again(prefix, attn[:, : prompt_len + step + 1], prompt_len + max_new)
            else:
                out = self.model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=attn[:, : prompt_len + step + 1],
                    position_ids=next_pos.unsqueeze(-1),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        resp_len = max(1, int(lengths.max()))
        response_mask = (torch.arange(resp_len, device=dev) < lengths.unsqueeze(-1)).float()
        return (tokens[:, :resp_len], response_mask, log_probs[:, :resp_len],
                None if versions is None else versions[:, :resp_len])

    def _prefill_again(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int) -> tuple[Any, torch.Tensor]:
        """A fresh KV cache of `ids` (left-padded prompt plus the tokens decoded so far, `mask` its
        attention) on the weights now, and the logits after its last token."""
        mask = mask.long()
        cache = make_decode_cache(self.model.config, capacity=capacity)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :]

    # ------------------------------------------------------------------ weights and memory

    def begin_weight_sync(self, names: Iterable[str]) -> None:
        """Nothing to prepare: every tensor is copied in place as it arrives."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors into the model in place (any dtype/device; cast on copy).

        Tied embeddings: the model's state dict lists both `lm_head.weight` and
        `model.embed_tokens.weight` for the one shared tensor, so either name updates it.
        """
        if self._targets is None:  # kept between syncs: the same tensors until the model moves
            self._targets = self._named_targets()
        targets = self._targets
        with torch.no_grad():
            for name, tensor in named_tensors:
                dst = targets.get(name)
                if dst is None:
                    raise ValueError(
                        f"update_weights: unknown parameter {name!r} "
                        f"(not in {type(self.model).__name__}'s state dict)"
                    )
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                        f"model has {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)

    def _named_targets(self) -> dict[str, torch.Tensor]:
        """Every name a weight may arrive under, including both names of a tied tensor.

        torch's state dict does not deduplicate, so a tied model lists the shared embedding under
        both names; the explicit alias covers models whose state dict omits the head.
        """
        targets: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        out_emb, in_emb = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
            targets.setdefault("lm_head.weight", in_emb.weight)
        return targets

    def sleep(self) -> None:
        """Move the weights to CPU and free the accelerator cache (no-op on a CPU engine)."""
        if self.device.type == "cpu" or self._asleep:
            return
        self.model.to("cpu")
        self._targets = None  # `.to` replaces buffers: their tensors are new
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Move the weights back onto the engine's device (no-op on a CPU engine)."""
        if not self._asleep:
            return
        self.model.to(self.device)
        self._targets = None
        self._asleep = False


