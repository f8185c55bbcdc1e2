"""rlcore: reinforcement-learning post-training for LLMs.

Three layers (see DESIGN.md): Prefect flows orchestrate model lifecycles, a single-controller
trainer runs the algorithm as a readable loop, and role workers (actor, rollout, reference,
critic, reward) do the computation on Ray or in-process.
"""

# Must equal the crate's version in rust/Cargo.toml (the wheel's version, and the extension's
# __version__); tests/test_native_version.py checks both.
__version__ = "0.1.0"

# Fails here, naming the fix, when the Rust extension is missing or stale (rlcore.native);
# RLCORE_NATIVE=off is the explicit, logged opt-out.
from rlcore.native import load as _load_native  # noqa: E402

_load_native(__version__)
