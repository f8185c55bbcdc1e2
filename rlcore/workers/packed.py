"""Packed sequences (remove padding): the index maps between a padded micro-batch and one packed row.

A micro-batch arrives padded, `[N, S]` with `S = P + R`: a left-padded prompt then a right-padded
response per row. The backbone instead runs on one row `[1, T]` holding every real token
(`attention_mask == 1`; never `response_mask`, which may have interior zeros where tool output is
attended to but not trained on) of every row, row after row, with per-sequence position ids that
restart at 0 and `cu_seqlens` marking where each sequence starts. `T` is the number of real tokens,
so the computed tokens equal the real ones. The sequences are ordered by length (ties: row order), so
that sequences of one length sit side by side and attention runs them as one batch.

Shared prompts (`pack_rows(..., input_ids=...)`, `model.share_prompt_prefix`): rows of a micro-batch
whose prompts are the same tokens (GRPO's n samples of a prompt, DPO's chosen and rejected) hold
that prompt once. The first such row (its "leader") is a sequence as above; every other row
contributes only its response tokens, which attend to the leader's prompt tokens and causally to
themselves (`SharedPrompts`). The hidden state of a prompt token depends on that prompt only, so
every log-prob, value and gradient is the one of the unshared row; the prompt's forward and backward
run once instead of once per row (`T` then counts fewer tokens than the real ones). Those response
tokens come first in the row, grouped by (prompt length, response length), then the sequences:
`cu_seqlens` starts at the first sequence's token.

Each response token is predicted by the hidden state of its predecessor in the packed row;
`predictor_index` holds that packed position, `response_index` where the result goes in the
`[N, R]` output. Both are fixed here, on the whole packed row, before anything is split: a
sequence-parallel rank that holds the packed positions `[a, b)` keeps the entries whose predictor
falls in its range, and every target is known there without talking to its neighbours.

For sequence parallelism, `PackedRows.shard` is one rank's slice of that row: the row padded to a
multiple of the group size (the pad tokens a sequence of their own at the end, never scored), its
tokens and position ids `[a, b)` (the global ones, so RoPE sees each token's own position), the
entries whose predictor lies in `[a, b)`, and the whole row's `cu_seqlens`, which attention needs
once the all-to-all has given each rank every token of a subset of heads
(`rlcore.workers.ulysses`).

Also here: `TokenTally`, the tokens each model's backbone actually computed against the real
tokens among them, read from the shapes of the forwards that ran (reported per step as
`perf/*_compute_token_ratio`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlcore.workers.ranks import global_sums

SHARED_PROMPTS_KWARG = "rlcore_shared_prompts"  # a `SharedPrompts`, passed through the backbone to attention


@dataclass(frozen=True)
class SharedPrompts:
    """The start of a packed row: responses of rows whose prompt is held by another row (its leader).

    Bucket i holds `count` responses of `response` tokens each, side by side, whose prompts have
    `prompt` tokens; attention gives each of them the keys `key_index` lists for it (the prompt's
    packed positions, then its own), causal from the bottom right: response token j sees the prompt
    and response tokens 0..j."""

    buckets: tuple[tuple[int, int, int], ...]  # (count, prompt tokens, response tokens)
    key_index: torch.Tensor  # [sum count * (prompt + response)] packed positions of the keys, bucket by bucket

    @property
    def tokens(self) -> int:
        """Packed tokens of these responses (they come first in the row)."""
        return sum(count * response for count, _, response in self.buckets)

    @property
    def max_seqlen(self) -> int:
        return max((prompt + response for _, prompt, response in self.buckets), default=0)


@dataclass(frozen=True)
class PackedRows:
    """Where the real tokens of a padded `[N, S]` micro-batch sit in one packed row `[1, T]`."""

    token_index: torch.Tensor      # [T] flat index into the padded [N * S] of each packed token
    position_ids: torch.Tensor     # [1, T] 0, 1, ... restarting at every sequence (a shared prompt's responses: after it)
    cu_seqlens: torch.Tensor       # [sequences + 1] int32 start of each sequence in the packed row (flash-attn's layout)
    seq_lens: tuple[int, ...]      # the sequences' lengths, on the host (what the per-sequence attention splits by)
    predictor_index: torch.Tensor  # [M] packed position of the hidden state that predicts each real response token
    response_index: torch.Tensor   # [M] flat index into [N * R] of that response token
    rows: int
    response_len: int
    pad_tokens: int = 0            # tokens at the end that are no real token's (a shard's part of the padding)
    shared: SharedPrompts | None = None  # responses at the start of the row that attend to another row's prompt
    shared_tokens: int = 0         # real prompt tokens not in the row because their leader holds them
    sequence_rows: tuple[int, ...] = ()  # the padded row each sequence (of `seq_lens`) is, in packed order

    @property
    def tokens(self) -> int:
        """Tokens in the packed row: T, all real, for a whole row; T / size for a shard."""
        return int(self.token_index.numel())

    @property
    def real_tokens(self) -> int:
        return self.tokens - self.pad_tokens

    @property
    def max_seqlen(self) -> int:
        """The longest sequence attention sees (a shared prompt's response counts with its prompt)."""
        return max(max(self.seq_lens, default=0), self.shared.max_seqlen if self.shared is not None else 0)

    def shard(self, rank: int, size: int) -> PackedRows:
        """Rank `rank`'s slice `[a, b)` of this row padded to a multiple of `size` tokens. Its
        predictor indices are local (`hidden` of the slice), `cu_seqlens`/`seq_lens` the whole
        padded row's (a pad sequence appended when there is padding)."""
        if not 0 <= rank < size:
            raise ValueError(f"sequence-parallel rank {rank} is not in 0..{size - 1}")
        total = self.tokens
        width = -(-total // size)
        pad = width * size - total
        a, b = rank * width, (rank + 1) * width
        token_index = torch.cat([self.token_index, self.token_index[:1].expand(pad)])  # any real id: never scored
        positions = torch.cat([self.position_ids[0], torch.arange(pad, device=self.position_ids.device)])
        cu_seqlens, seq_lens = self.cu_seqlens, self.seq_lens
        if pad:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + pad])])
            seq_lens = (*seq_lens, pad)
        keep = (self.predictor_index >= a) & (self.predictor_index < b)
        saved = self.shared_tokens // size + (self.shared_tokens % size if rank == 0 else 0)  # summed over ranks: all
        return PackedRows(
            token_index[a:b], positions[a:b].unsqueeze(0), cu_seqlens, seq_lens, self.predictor_index[keep] - a,
            self.response_index[keep], self.rows, self.response_len, pad_tokens=max(0, b - max(a, total)),
            shared=self.shared, shared_tokens=saved, sequence_rows=self.sequence_rows,
        )

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """A padded `[N, S, ...]` tensor (input ids, say) as the packed `[1, T, ...]` row."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.token_index).unsqueeze(0)

    def predictors(self, hidden: torch.Tensor) -> torch.Tensor:
        """The `[M, ...]` hidden states that predict the real response tokens, from the packed `[1, T, ...]`."""
        return hidden[0].index_select(0, self.predictor_index)

    def targets(self, responses: torch.Tensor) -> torch.Tensor:
        """The `[M]` real response tokens of `responses` `[N, R]`, in the order of `predictors`."""
        return responses.reshape(-1).index_select(0, self.response_index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token `[M]` values back to `[N, R]`; 0 where a response position is padding."""
        out = values.new_zeros(self.rows * self.response_len)
        return out.index_copy(0, self.response_index, values).view(self.rows, self.response_len)

    def backbone_kwargs(self) -> dict[str, Any]:
        """What the transformers backbone is called with: no padding mask (so transformers builds
        none), the packed position ids, and flash-attn's varlen keywords, which transformers passes
        through every decoder layer to the attention function (`rlcore.workers.attention`), with the
        shared prompts' responses when there are any (`SHARED_PROMPTS_KWARG`)."""
        kwargs: dict[str, Any] = {
            "attention_mask": None,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }
        if self.shared is not None:
            kwargs[SHARED_PROMPTS_KWARG] = self.shared
        return kwargs


def pack_rows(attention_mask: torch.Tensor, response_len: int, input_ids: torch.Tensor | None = None) -> PackedRows:
    """The packing of a padded micro-batch whose last `response_len` columns are the responses.
    With `input_ids`, rows whose real prompt tokens are the same hold their prompt once (the module
    docstring); without, every row is a sequence of its own.

    A response token is scored only when it is real and has a real predecessor in its row (the
    first real token of a row predicts nothing: a prompt is never empty)."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [rows, tokens], got shape {tuple(attention_mask.shape)}")
    n, s = attention_mask.shape
    if not 0 <= response_len <= s:
        raise ValueError(f"response length {response_len} does not fit rows of {s} tokens")
    real = attention_mask.bool()
    device = real.device
    p = s - response_len
    rows = torch.arange(n, device=device)
    leader = prompt_leaders(input_ids[:, :p], real[:, :p]) if input_ids is not None else rows
    follower = leader != rows
    own = real.clone()  # the tokens each row puts in the packed row: all (leaders), the response's (followers)
    own[:, :p] &= ~follower[:, None]
    own_lens, prompt_lens, is_follower = own.sum(1).tolist(), real[:, :p].sum(1).tolist(), follower.tolist()
    followers = sorted((i for i in range(n) if is_follower[i] and own_lens[i]), key=lambda i: (prompt_lens[i], own_lens[i], i))
    leaders = sorted((i for i in range(n) if not is_follower[i]), key=lambda i: (own_lens[i], i))
    order = torch.tensor(followers + leaders, dtype=torch.long, device=device)
    at = own.index_select(0, order).reshape(-1).nonzero().squeeze(1)  # token k of the packed row: at[k] in [order rows, S]
    token_index = order[at // s] * s + at % s
    positions = (real.long().cumsum(1) - 1).reshape(-1).index_select(0, token_index).unsqueeze(0)
    packed_at = torch.full((n * s,), -1, dtype=torch.long, device=device)
    packed_at[token_index] = torch.arange(token_index.numel(), device=device)
    packed_at = packed_at.view(n, s)
    if followers:  # a follower's prompt tokens are its leader's
        packed_at[follower, :p] = packed_at[leader[follower], :p]
    column = torch.arange(s, device=device).expand(n, s)
    before = torch.cat([column.new_full((n, 1), -1), torch.where(real, column, -1).cummax(1).values[:, :-1]], 1)
    scored = real[:, p:] & (before[:, p:] >= 0)  # the last real column before each slot, -1 if none
    response_index = scored.reshape(-1).nonzero().squeeze(1)
    r_row = response_index // max(response_len, 1)
    predictor_index = packed_at[r_row, before[:, p:].reshape(-1).index_select(0, response_index)]
    lens = [own_lens[i] for i in leaders]
    first = sum(own_lens[i] for i in followers)
    cu_seqlens = torch.tensor(list(itertools.accumulate(lens, initial=first)), dtype=torch.int32, device=device)
    shared = None
    if followers:
        f = torch.tensor(followers, dtype=torch.long, device=device)
        key_index = packed_at.index_select(0, f)[real.index_select(0, f)]  # each follower's prompt, then its response
        buckets = [(len(list(g)), lp, lq) for (lp, lq), g in itertools.groupby(followers, key=lambda i: (prompt_lens[i], own_lens[i]))]
        shared = SharedPrompts(tuple(buckets), key_index)
    return PackedRows(token_index, positions, cu_seqlens, tuple(lens), predictor_index, response_index, n, response_len,
                      shared=shared, shared_tokens=sum(lp for lp, f in zip(prompt_lens, is_follower) if f),
                      sequence_rows=tuple(leaders))


def prompt_leaders(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """For each row, the first row whose real prompt tokens (`prompt_mask`) are the same ids in the
    same columns; a row with an empty prompt is its own."""
    first: dict[tuple[int, ...], int] = {}
    keys = torch.where(prompt_mask.bool(), prompt_ids, -1).tolist()
    leaders = [first.setdefault(tuple(key), i) if any(x >= 0 for x in key) else i for i, key in enumerate(keys)]
    return torch.tensor(leaders, dtype=torch.long, device=prompt_ids.device)


class TokenTally:
    """Tokens a model's backbone computed (the shapes it ran on, padding included) and the real
    tokens among them, summed over forwards until `take`. Real counts stay tensors until then, so
    counting adds no device synchronisation to a forward."""

    def __init__(self) -> None:
        self._computed = 0
        self._real: torch.Tensor | int = 0
        self.copies = 1  # ranks that run the same tokens (tensor-parallel ranks): each counts 1/copies of them

    def add(self, computed: int, real: torch.Tensor | int) -> None:
        self._computed += int(computed)
        self._real = self._real + (real.detach().sum() if isinstance(real, torch.Tensor) else int(real))

    def take(self) -> tuple[float, float]:
        """(computed, real) since the last `take`, and start again."""
        counts = float(self._computed) / self.copies, float(self._real) / self.copies
        self._computed, self._real = 0, 0
        return counts


_TALLIES: weakref.WeakKeyDictionary[nn.Module, TokenTally] = weakref.WeakKeyDictionary()


def token_tally(model: nn.Module) -> TokenTally:
    """The tally of `model`'s forwards (one per model object, FSDP-wrapped or not)."""
    tally = _TALLIES.get(model)
    if tally is None:
        tally = _TALLIES[model] = TokenTally()
    return tally


def forward_token_metrics(role: str, model: nn.Module, device: torch.device) -> dict[str, float]:
    """`perf/<role>_compute_tokens`, `_real_tokens` and their ratio over every forward of `model`
    since the last call, summed over ranks (a collective: every rank calls it)."""
    computed, real = global_sums(list(token_tally(model).take()), device)
    return {
        f"perf/{role}_compute_tokens": computed,
        f"perf/{role}_real_tokens": real,
        f"perf/{role}_compute_token_ratio": computed / real if real else math.nan,
    }


__all__ = ["SHARED_PROMPTS_KWARG", "PackedRows", "SharedPrompts", "TokenTally", "forward_token_metrics", "pack_rows",
           "prompt_leaders", "token_tally"]
