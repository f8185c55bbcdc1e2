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

# Every log record this process makes has its secrets redacted, whoever logs it (rlcore, Prefect,
# Ray, transformers) and wherever it goes (rlcore.redact): one policy for every log line.
from rlcore.redact import install_log_redaction as _install_log_redaction  # noqa: E402

_install_log_redaction()
