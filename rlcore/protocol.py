"""`Batch`: the one data structure that crosses a worker boundary.

A batch is three dicts: batch-first tensors, per-sample numpy metadata (uids, data sources, ground
truths: things a tensor cannot hold), and batch-level ``info``: data about the batch only (the
loader's epoch, how `concat` right-pads: `RIGHT_PAD`). What to do with a batch (sampling
parameters, samples per prompt, an objective) is a typed argument of the worker method, and
metrics come back beside the batch, never inside it (`rlcore.trainer.groups`).
Every operation returns a new `Batch`; tensors may share storage with the source (slices are
views), the dicts never do. Pickling goes through numpy buffers because Ray moves numpy arrays
~3x faster than pickled torch tensors (see FIELD_NOTES).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = ["Batch"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_meta_array(key: str, value: Any) -> np.ndarray:
    """Meta values are 1+-D numpy arrays; lists become object arrays (one element per sample)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"Batch meta {key!r} is a torch.Tensor: put tensors in `tensors`")
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"Batch meta {key!r} is a 0-d array: meta values are per-sample")
        return value
    if isinstance(value, (list, tuple)):
        # Fill element by element so lists of lists/dicts stay one object per sample.
        arr = np.empty(len(value), dtype=object)
        for i, v in enumerate(value):
            arr[i] = v
        return arr
    raise TypeError(
        f"Batch meta {key!r} must be a numpy array or a list, got {type(value).__name__}"
    )


def _as_index(indices: Any, n: int) -> np.ndarray:
    """Normalise list/array/tensor/range indices (or a boolean mask) to non-negative int64."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"boolean mask has shape {idx.shape}, batch has {n} rows")
        return np.flatnonzero(idx)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices must be integers or a boolean mask, got dtype {idx.dtype}")
    idx = idx.astype(np.int64).reshape(-1)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"index {int(idx[bad][0])} is out of range for a batch of {n} rows")
    return np.where(idx < 0, idx + n, idx)


def _same(a: Any, b: Any) -> bool:
    """Exact equality for tensors, arrays (object ones too) and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        try:
            return bool(np.array_equal(a, b))
        except (ValueError, TypeError):  # object arrays holding arrays: compare one by one
            return all(_same(x, y) for x, y in zip(a.ravel(), b.ravel()))
    try:
        return bool(a == b)
    except (ValueError, TypeError, RuntimeError):
        return a is b


RIGHT_PAD = "right_pad"  # Batch.info key: the tensors concat may right-pad, and with what


def _right_padded(batches: list[Batch], right_pad: dict[str, float | str]) -> list[Batch]:
    """`batches` with the tensors named in `right_pad` right-padded (dim 1) to the widest of them."""
    keys = [k for k in right_pad if all(k in b.tensors and b.tensors[k].ndim >= 2 for b in batches)]
    widths = {k: max(b.tensors[k].shape[1] for b in batches) for k in keys}
    out = []
    for b in batches:
        tensors = dict(b.tensors)
        for k in keys:
            t, extra = tensors[k], widths[k] - tensors[k].shape[1]
            if extra > 0:
                fill = right_pad[k]
                if isinstance(fill, str) and fill != "edge":
                    raise ValueError(f"Batch.concat: info[{RIGHT_PAD!r}][{k!r}] is {fill!r}: a number or 'edge'")
                tail = (t[:, -1:].expand(-1, extra, *t.shape[2:]) if isinstance(fill, str)  # "edge"
                        else t.new_full((t.shape[0], extra, *t.shape[2:]), fill))
                tensors[k] = torch.cat([t, tail], dim=1)
        out.append(Batch(tensors=tensors, meta=b.meta, info=b.info))
    return out


@dataclass(eq=False)
class Batch:
    """Batch-first tensors + per-sample numpy meta + batch-level info, all with one length."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors or {})
        self.meta = {k: _to_meta_array(k, v) for k, v in (self.meta or {}).items()}
        self.info = dict(self.info or {})
        for k, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Batch tensor {k!r} is a {type(t).__name__}, not a torch.Tensor")
            if t.ndim == 0:
                raise ValueError(f"Batch tensor {k!r} is 0-d: tensors are batch-first")
        both = self.tensors.keys() & self.meta.keys()
        if both:
            raise ValueError(f"Batch key {sorted(both)[0]!r} is in both tensors and meta")
        first: tuple[str, int] | None = None
        for k, n in self._leading_sizes():
            if first is None:
                first = (k, n)
            elif n != first[1]:
                raise ValueError(
                    f"Batch key {k!r} has leading size {n}, but {first[0]!r} has {first[1]}"
                )

    def _leading_sizes(self) -> Iterable[tuple[str, int]]:
        yield from ((k, t.shape[0]) for k, t in self.tensors.items())
        yield from ((k, a.shape[0]) for k, a in self.meta.items())

    # ----- access -------------------------------------------------------------------------

    def __len__(self) -> int:
        for _, n in self._leading_sizes():
            return int(n)
        return 0

    def __getitem__(self, key: str | slice) -> torch.Tensor | np.ndarray | Batch:
        """`batch["input_ids"]` -> tensor, `batch["uid"]` -> meta array, `batch[2:5]` -> Batch."""
        if isinstance(key, slice):
            return self.take(range(len(self))[key])
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"Batch has no key {key!r}; keys: {self.keys()}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace one key (tensors go to `tensors`, anything else to `meta`)."""
        new: torch.Tensor | np.ndarray
        if isinstance(value, torch.Tensor):
            if value.ndim == 0:
                raise ValueError(f"Batch tensor {key!r} is 0-d: tensors are batch-first")
            new = value
        else:
            new = _to_meta_array(key, value)
        for other, n in self._leading_sizes():
            if other != key:
                if new.shape[0] != n:
                    raise ValueError(
                        f"Batch key {key!r} has leading size {new.shape[0]}, but {other!r} has {n}"
                    )
                break
        self.tensors.pop(key, None)
        self.meta.pop(key, None)
        if isinstance(new, torch.Tensor):
            self.tensors[key] = new
        else:
            self.meta[key] = new

    def pop(self, key: str) -> torch.Tensor | np.ndarray:
        """Remove one key and return its value."""
        if key in self.tensors:
            return self.tensors.pop(key)
        if key in self.meta:
            return self.meta.pop(key)
        raise KeyError(f"Batch has no key {key!r}; keys: {self.keys()}")

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.meta

    def __iter__(self) -> NoReturn:
        raise TypeError("Batch is not iterable: use keys(), split(size) or chunk(n)")

    def keys(self) -> list[str]:
        """Tensor keys, then meta keys."""
        return [*self.tensors, *self.meta]

    def __repr__(self) -> str:
        ts = ", ".join(f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                       for k, t in self.tensors.items())
        ms = ", ".join(f"{k}: {a.dtype}" for k, a in self.meta.items())
        return f"Batch(len={len(self)}, tensors={{{ts}}}, meta={{{ms}}}, info={sorted(self.info)})"

    def equal(self, other: Batch) -> bool:
        """True when keys, dtypes, shapes, values and info are all identical."""
        return (
            isinstance(other, Batch)
            and self.tensors.keys() == other.tensors.keys()
            and self.meta.keys() == other.meta.keys()
            and self.info.keys() == other.info.keys()
            and all(_same(v, other.tensors[k]) for k, v in self.tensors.items())
            and all(_same(v, other.meta[k]) for k, v in self.meta.items())
            and all(_same(v, other.info[k]) for k, v in self.info.items())
        )

    # ----- reshaping ----------------------------------------------------------------------

    def select(self, *keys: str) -> Batch:
        """Only the given keys (from tensors or meta); info is kept."""
        for k in keys:
            if k not in self:
                raise KeyError(f"Batch has no key {k!r}; keys: {self.keys()}")
        return Batch(
            tensors={k: self.tensors[k] for k in keys if k in self.tensors},
            meta={k: self.meta[k] for k in keys if k in self.meta},
            info=self.info,
        )

    def _slice(self, start: int, stop: int) -> Batch:
        return Batch(
            tensors={k: t[start:stop] for k, t in self.tensors.items()},
            meta={k: a[start:stop] for k, a in self.meta.items()},
            info=self.info,
        )

    def take(self, indices: Sequence[int] | np.ndarray | torch.Tensor | range) -> Batch:
        """Rows in the given order (reorder, subset, duplicate); a boolean mask filters."""
        idx = _as_index(indices, len(self))
        return Batch(
            tensors={k: t.index_select(0, torch.as_tensor(idx, device=t.device))
                     for k, t in self.tensors.items()},
            meta={k: a[idx] for k, a in self.meta.items()},
            info=self.info,
        )

    def chunk(self, n: int) -> list[Batch]:
        """Split into `n` contiguous parts whose sizes differ by at most one (larger first).

        Exactly `n` parts when len >= n; with fewer rows than `n`, one part per row (like
        torch.chunk, no empty parts); an empty batch gives one empty part.
        """
        if n < 1:
            raise ValueError(f"chunk(n) needs n >= 1, got {n}")
        size = len(self)
        if size == 0:
            return [self._slice(0, 0)]
        n = min(n, size)
        q, r = divmod(size, n)
        out, start = [], 0
        for i in range(n):
            stop = start + q + (1 if i < r else 0)
            out.append(self._slice(start, stop))
            start = stop
        return out

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of `size` rows; the last one may be shorter."""
        if size < 1:
            raise ValueError(f"split(size) needs size >= 1, got {size}")
        n = len(self)
        return [self._slice(s, min(s + size, n)) for s in range(0, n, size)] or [self._slice(0, 0)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; keys must match; info comes from the first batch.

        Tensors named in the first batch's `info[RIGHT_PAD]` ({key: fill value, or "edge" to
        repeat the last column}) may differ in width: they are right-padded to the widest first
        (rollout ranks' responses, each as wide as its own longest)."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        right_pad: dict[str, float | str] = first.info.get(RIGHT_PAD) or {}
        if right_pad and len(batches) > 1:
            batches = _right_padded(batches, right_pad)
            first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for name, mine, theirs in (("tensor", first.tensors, b.tensors),
                                       ("meta", first.meta, b.meta)):
                diff = mine.keys() ^ theirs.keys()
                if diff:
                    k = sorted(diff)[0]
                    where = "batch 0" if k in mine else f"batch {i}"
                    raise ValueError(f"Batch.concat: {name} key {k!r} is only in {where}")
        tensors = {}
        for k, t0 in first.tensors.items():
            for i, b in enumerate(batches):
                t = b.tensors[k]
                if t.shape[1:] != t0.shape[1:]:
                    raise ValueError(
                        f"Batch.concat: tensor {k!r} has shape {tuple(t0.shape)} in batch 0 but "
                        f"{tuple(t.shape)} in batch {i} (pad to a common length first)"
                    )
                if t.dtype != t0.dtype:
                    raise ValueError(
                        f"Batch.concat: tensor {k!r} is {t0.dtype} in batch 0 "
                        f"but {t.dtype} in batch {i}"
                    )
            tensors[k] = torch.cat([b.tensors[k] for b in batches], dim=0)
        meta = {}
        for k in first.meta:
            try:
                meta[k] = np.concatenate([b.meta[k] for b in batches], axis=0)
            except ValueError as e:
                raise ValueError(f"Batch.concat: meta {k!r}: {e}") from e
        return Batch(tensors=tensors, meta=meta, info=first.info)

    def union(self, other: Batch) -> Batch:
        """Keys of both batches (same length). A key in both must hold equal values."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"Batch.union: lengths differ ({len(self)} vs {len(other)})")
        tensors, meta, info = dict(self.tensors), dict(self.meta), dict(self.info)
        merged: tuple[dict[str, Any], ...] = (tensors, meta, info)
        sources: tuple[dict[str, Any], ...] = (other.tensors, other.meta, other.info)
        for kind, dst, src in zip(("tensor", "meta", "info"), merged, sources):
            for k, v in src.items():
                if k in dst and not _same(dst[k], v):
                    raise ValueError(f"Batch.union: {kind} {k!r} differs between the two batches")
                dst[k] = v
        return Batch(tensors=tensors, meta=meta, info=info)

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated `n` times consecutively (GRPO: n samples per prompt), meta too."""
        if n < 1:
            raise ValueError(f"repeat_interleave(n) needs n >= 1, got {n}")
        return Batch(
            tensors={k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()},
            meta={k: np.repeat(a, n, axis=0) for k, a in self.meta.items()},
            info=self.info,
        )

    def to(self, device: str | torch.device) -> Batch:
        """Tensors moved to `device` (meta and info untouched)."""
        return Batch(tensors={k: t.to(device) for k, t in self.tensors.items()},
                     meta=self.meta, info=self.info)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first rows until len is a multiple of `k`; returns (batch, n_pad).

        Padding repeats real rows (not zeros) so padded samples are valid inputs for any worker.
        `unpad(n_pad)` drops them again.
        """
        if k < 1:
            raise ValueError(f"pad_to_multiple(k) needs k >= 1, got {k}")
        n = len(self)
        n_pad = (-n) % k
        if n_pad == 0:
            return self._slice(0, n), 0
        return Batch.concat([self, self.take(np.arange(n_pad) % n)]), n_pad

    def unpad(self, n_pad: int) -> Batch:
        """Drop the last `n_pad` rows (undoes pad_to_multiple)."""
        if not 0 <= n_pad <= len(self):
            raise ValueError(f"unpad({n_pad}) on a batch of {len(self)} rows")
        return self._slice(0, len(self) - n_pad)

    # ----- serialisation ------------------------------------------------------------------

    def numpy_state(self) -> dict[str, Any]:
        """Tensors as (dtype name, numpy array) on CPU; dtypes numpy lacks (bfloat16, float8)
        travel as same-width integer views."""
        tensors = {}
        for k, t in self.tensors.items():
            t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
            name = str(t.dtype).removeprefix("torch.")
            try:
                arr = t.numpy()
            except TypeError:
                arr = t.view(_INT_VIEW[t.element_size()]).numpy()
            tensors[k] = (name, arr)
        return {"tensors": tensors, "meta": dict(self.meta), "info": dict(self.info)}

    @classmethod
    def from_numpy_state(cls, state: dict[str, Any]) -> Batch:
        """Inverse of numpy_state(); tensors land on CPU."""
        tensors = {}
        for k, (name, arr) in state["tensors"].items():
            if not arr.flags.writeable:  # zero-copy buffers (Ray object store) are read-only
                arr = arr.copy()
            t = torch.from_numpy(arr)
            dtype = getattr(torch, name)
            tensors[k] = t if t.dtype == dtype else t.view(dtype)
        return cls(tensors=tensors, meta=state["meta"], info=state["info"])

    def __getstate__(self) -> dict[str, Any]:
        return self.numpy_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        b = Batch.from_numpy_state(state)
        self.tensors, self.meta, self.info = b.tensors, b.meta, b.info
