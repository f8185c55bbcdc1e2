"""The pure-Python packing used under RLCORE_NATIVE=off gives exactly what the Rust kernel gives,
so switching the extension off for debugging changes speed, not results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import _native
from rlcore.packing import pack_token_budget_python


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 120), max_size=80), st.integers(1, 150))
def test_python_packing_equals_native(lengths, budget):
    assert pack_token_budget_python(lengths, budget) == _native.pack_token_budget(lengths, budget)


def test_python_packing_golden_and_ties():
    # 11 is oversize: a closed bin of its own that even the empty sample 5 may not join.
    assert pack_token_budget_python([4, 8, 11, 2, 6, 0], 10) == [[0, 4], [1, 3, 5], [2]]
    # Equal lengths go in index order: 0 and 1 fill the first bin, 2 opens the next.
    assert pack_token_budget_python([5, 5, 5], 10) == [[0, 1], [2]]
    lengths = np.random.default_rng(0).integers(1, 2048, size=500)
    assert pack_token_budget_python(lengths, 4096) == _native.pack_token_budget(lengths, 4096)


def test_python_packing_rejects_what_native_rejects():
    with pytest.raises(ValueError, match="max_tokens: must be >= 1, got 0"):
        pack_token_budget_python([1], 0)
    with pytest.raises(ValueError, match="lengths: must be >= 0, got -1 at index 1"):
        pack_token_budget_python([1, -1], 5)
