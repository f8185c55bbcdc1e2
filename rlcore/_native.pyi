"""Type stubs for rlcore._native, the Rust numeric core (crate in rust/, built by maturin).

Every function releases the GIL while it computes and spreads rows over threads (rayon; set
RAYON_NUM_THREADS to cap them). Inputs may be numpy arrays or CPU torch tensors (read without
a copy through ``__array__`` when contiguous; tensors that require grad or live on a GPU are
rejected). Outputs are numpy arrays or Python lists. Bad input raises ``ValueError`` whose
message starts with the argument's name, e.g.
``"values: expected shape (4, 7) like rewards, got (4, 6)"``.
"""

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

ArrayLike = Any  # numpy array, CPU torch tensor, or anything numpy.asarray accepts

GroupMode = Literal["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"]

__version__: str
"""The crate's version (rust/Cargo.toml); ``import rlcore`` refuses an extension whose version
differs from ``rlcore.__version__`` (a stale build)."""

def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    mask: ArrayLike,
    gamma: float,
    lam: float,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Masked generalised advantage estimation (verl's recurrence), unwhitened.

    ``rewards`` and ``values``: float32 [B, T]; ``mask``: [B, T] float32/float64/bool/any int.
    Returns ``(advantages, returns)``, float32 [B, T]. Per row, for t = T-1 .. 0, starting
    from ``nextvalue = lastgae = 0``::

        delta     = r[t] + gamma * nextvalue - v[t]
        g         = delta + gamma * lam * lastgae
        nextvalue = v[t] * m[t] + (1 - m[t]) * nextvalue
        lastgae   = g * m[t] + (1 - m[t]) * lastgae
        adv[t]    = g
        ret[t]    = g + v[t]

    so masked tokens update neither the bootstrap value nor the running advantage (verl's
    multi-turn GAE; at masked positions verl stores the carried ``lastgae`` where we store ``g``,
    positions no loss reads). f32 arithmetic in exactly this order: matches the torch loop in
    ``rlcore.algos.advantages.gae_raw`` to rounding. NaN/inf in any input, or a non-finite
    gamma/lam, raises ValueError.
    """

def discounted_returns(rewards: ArrayLike, mask: ArrayLike, gamma: float) -> npt.NDArray[np.float32]:
    """REINFORCE++ discounted return-to-go with resets (verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` before whitening).

    ``rewards`` float32 [B, T], ``mask`` [B, T] (float/bool/int). Per row backwards from
    ``running = 0``: ``running = r[t] + gamma * running; out[t] = running; running *= m[t]``:
    a masked position is written, then cuts the sum so nothing flows back across it.
    """

def group_advantages(
    scores: ArrayLike,
    group_ids: ArrayLike,
    mode: GroupMode = "grpo",
    eps: float = 1e-6,
) -> npt.NDArray[np.float32]:
    """Outcome advantage of each sample relative to its group (the n samples of a prompt).

    ``scores`` float32 [B]; ``group_ids`` [B] of any integer dtype, arbitrary values, in any
    order (equal ids form a group). With the group's mean and unbiased std (torch.std), computed
    in float64:

    - ``"grpo"``: (s - mean) / (std + eps); a group whose scores are all equal gives 0
    - ``"drgrpo"``: s - mean
    - ``"rloo"``: (s - mean) * n / (n - 1), i.e. s minus the mean of the other samples
    - ``"reinforce_plus_plus_baseline"``: s - mean

    A group of one sample keeps its raw score in every mode. ``eps`` must be finite and >= 0.
    """

def pack_token_budget(lengths: ArrayLike | Sequence[int], max_tokens: int) -> list[list[int]]:
    """Token-budget micro-batches: lists of sample indices whose lengths sum to at most
    ``max_tokens`` (first-fit decreasing). A sample longer than the budget gets a bin of its own.

    ``lengths``: 1-D, any integer dtype, each >= 0; ``max_tokens`` >= 1. Deterministic: indices
    ascending within a bin, bins ordered by their smallest index. Uses at most
    11/9 * optimal + 1 bins, usually within one of ceil(sum / max_tokens).
    """

def balanced_partitions(
    lengths: ArrayLike | Sequence[int], k: int, equal_size: bool = True
) -> list[list[int]]:
    """``k`` partitions of ``range(len(lengths))`` with near-equal length totals, by the
    Karmarkar-Karp largest differencing method (as verl's ``get_seqlen_balanced_partitions``).

    ``equal_size=True``: every partition gets exactly len/k items (len must be divisible by k).
    Needs ``k >= 1`` and at least k items. Deterministic, and identical to
    ``rlcore.packing.balanced_partitions_python``: indices ascending within a partition,
    partitions ordered by their smallest index.
    """
