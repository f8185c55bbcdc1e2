"""Loading the Rust extension ``rlcore._native``, checked, with no silent fallback.

``import rlcore`` calls :func:`load` once. The extension must be there, built from this version of
the sources (its ``__version__``, the crate's version, must equal ``rlcore.__version__``) and
export every function the Python code calls; otherwise the import fails with
:class:`NativeBuildError` saying how to rebuild. A stale build (left over in place from other
sources, or from a wheel of another release) would otherwise run kernels that disagree with the
Python code around them, and a missing one used to make the trainer quietly use the slower torch
paths.

``RLCORE_NATIVE=off`` is the one way to run without it (debugging the reference paths, or a
machine that cannot build Rust): the extension is not imported, a warning says so at import, and
advantages, packing and partitions run their torch/Python reference implementations, which
compute the same results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["ENV_VAR", "REQUIRED_FUNCTIONS", "NativeBuildError", "check_module", "enabled", "function", "load", "module"]

ENV_VAR = "RLCORE_NATIVE"
#: What the Python code calls; an extension without one of them is a stale build.
REQUIRED_FUNCTIONS = ("gae", "discounted_returns", "group_advantages", "pack_token_budget", "balanced_partitions")
_REBUILD = "rebuild it with `./dev setup` (or `maturin develop --release`, or `pip install .`)"

log = logging.getLogger("rlcore.native")
_module: ModuleType | None = None
_loaded = False


class NativeBuildError(ImportError):
    """The extension is missing, of another version, or lacks a function: rebuild it."""


def _mode() -> str:
    value = os.environ.get(ENV_VAR, "on").strip().lower()
    if value in ("", "on", "1", "true"):
        return "on"
    if value in ("off", "0", "false"):
        return "off"
    raise ValueError(f"{ENV_VAR}={value!r}: expected 'on' (default) or 'off'")


def check_module(mod: ModuleType, expected_version: str) -> None:
    """Raise :class:`NativeBuildError` unless ``mod`` is the extension of ``expected_version``."""
    where = getattr(mod, "__file__", None) or "<no file>"
    version = getattr(mod, "__version__", None)
    if version != expected_version:
        raise NativeBuildError(
            f"rlcore._native at {where} is version {version!r} but rlcore is {expected_version!r}: "
            f"a stale build; {_REBUILD}"
        )
    missing = [name for name in REQUIRED_FUNCTIONS if not callable(getattr(mod, name, None))]
    if missing:
        raise NativeBuildError(f"rlcore._native at {where} lacks {missing}: a stale build; {_REBUILD}")


def load(expected_version: str) -> ModuleType | None:
    """Import and check the extension (once); None only when ``RLCORE_NATIVE=off``."""
    global _module, _loaded
    if _loaded:
        return _module
    if _mode() == "off":
        log.warning(
            "%s=off: rlcore._native is not loaded; advantages, packing and partitions run the slower "
            "torch/Python reference code (for debugging; unset it for real runs)",
            ENV_VAR,
        )
        _module, _loaded = None, True
        return None
    try:
        from rlcore import _native
    except ImportError as e:
        raise NativeBuildError(
            f"rlcore._native cannot be imported ({e}); {_REBUILD}. "
            f"{ENV_VAR}=off runs the torch/Python reference code instead (debugging only)"
        ) from e
    check_module(_native, expected_version)
    _module, _loaded = _native, True
    return _native


def module() -> ModuleType | None:
    """The checked extension, or None when ``RLCORE_NATIVE=off``."""
    if not _loaded:
        from rlcore import __version__

        return load(__version__)
    return _module


def enabled() -> bool:
    """Whether the native kernels are in use (False only under ``RLCORE_NATIVE=off``)."""
    return module() is not None


def function(name: str) -> Callable[..., Any] | None:
    """The extension's function ``name``, or None when ``RLCORE_NATIVE=off``.

    Looked up on every call, not cached, so a test can wrap the module's functions.
    """
    mod = module()
    if mod is None:
        return None
    fn: Callable[..., Any] = getattr(mod, name)
    return fn
