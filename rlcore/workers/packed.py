"""Packed sequences (remove padding): the index maps between a padded micro-batch and one packed row.

A micro-batch arrives padded, `[N, S]` with `S = P + R`: a left-padded prompt then a right-padded
response per row. The backbone instead runs on one row `[1, T]` holding every real token
(`attention_mask == 1`; never `response_mask`, which may have interior zeros where tool output is
attended to but not trained on) of every row, row after row, with per-sequence position ids that
restart at 0 and `cu_seqlens` marking where each sequence starts. `T` is the number of real tokens,
so the computed tokens equal the real ones.

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

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlcore.workers.ranks import global_sums


@dataclass(frozen=True)
class PackedRows:
    """Where the real tokens of a padded `[N, S]` micro-batch sit in one packed row `[1, T]`."""

    token_index: torch.Tensor      # [T] flat index into the padded [N * S] of each packed token, rows in order
    position_ids: torch.Tensor     # [1, T] 0, 1, ... restarting at every sequence
    cu_seqlens: torch.Tensor       # [N + 1] int32 start of each sequence in the packed row (flash-attn's layout)
    seq_lens: tuple[int, ...]      # N real lengths, on the host (what the per-sequence attention splits by)
    predictor_index: torch.Tensor  # [M] packed position of the hidden state that predicts each real response token
    response_index: torch.Tensor   # [M] flat index into [N * R] of that response token
    rows: int
    response_len: int
    pad_tokens: int = 0            # tokens at the end that are no real token's (a shard's part of the padding)

    @property
    def tokens(self) -> int:
        """Tokens in the packed row: T, all real, for a whole row; T / size for a shard."""
        return int(self.token_index.numel())

    @property
    def real_tokens(self) -> int:
        return self.tokens - self.pad_tokens

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens, default=0)

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
        return PackedRows(
            token_index[a:b], positions[a:b].unsqueeze(0), cu_seqlens, seq_lens, self.predictor_index[keep] - a,
            self.response_index[keep], self.rows, self.response_len, pad_tokens=max(0, b - max(a, total)),
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
        through every decoder layer to the attention function (`rlcore.workers.attention`)."""
        return {
            "attention_mask": None,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


def pack_rows(attention_mask: torch.Tensor, response_len: int) -> PackedRows:
    """The packing of a padded micro-batch whose last `response_len` columns are the responses.

    A response token is scored only when it is real and has a real predecessor in its row (the
    first real token of a row predicts nothing: a prompt is never empty)."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [rows, tokens], got shape {tuple(attention_mask.shape)}")
    n, s = attention_mask.shape
    if not 0 <= response_len <= s:
        raise ValueError(f"response length {response_len} does not fit rows of {s} tokens")
    real = attention_mask.bool()
    flat = real.reshape(-1)
    token_index = flat.nonzero().squeeze(1)
    lens = real.sum(1)
    starts = torch.cumsum(lens, 0) - lens
    cu_seqlens = torch.cat([starts, starts[-1:] + lens[-1:]] if n else [lens.new_zeros(1)]).to(torch.int32)
    seq_lens = tuple(int(x) for x in lens.tolist())
    row_of_token = torch.repeat_interleave(torch.arange(n, device=lens.device), lens)
    position_ids = (torch.arange(token_index.numel(), device=lens.device) - starts[row_of_token]).unsqueeze(0)
    packed_at = (torch.cumsum(flat.long(), 0) - 1).view(n, s)[:, s - response_len:]  # packed position of each response slot
    scored = real[:, s - response_len:] & (packed_at > starts[:, None])
    response_index = scored.reshape(-1).nonzero().squeeze(1)
    predictor_index = packed_at.reshape(-1).index_select(0, response_index) - 1
    return PackedRows(token_index, position_ids, cu_seqlens, seq_lens, predictor_index, response_index, n, response_len)


class TokenTally:
    """Tokens a model's backbone computed (the shapes it ran on, padding included) and the real
    tokens among them, summed over forwards until `take`. Real counts stay tensors until then, so
    counting adds no device synchronisation to a forward."""

    def __init__(self) -> None:
        self._computed = 0
        self._real: torch.Tensor | int = 0

    def add(self, computed: int, real: torch.Tensor | int) -> None:
        self._computed += int(computed)
        self._real = self._real + (real.detach().sum() if isinstance(real, torch.Tensor) else int(real))

    def take(self) -> tuple[float, float]:
        """(computed, real) since the last `take`, and start again."""
        counts = float(self._computed), float(self._real)
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


__all__ = ["PackedRows", "TokenTally", "forward_token_metrics", "pack_rows", "token_tally"]
