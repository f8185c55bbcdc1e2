"""The base of rlcore's own errors: problems in what the user gave (config, data, reward
functions, checkpoints, paths) whose message says what and where.

The `rlcore` command prints such an error as one message on stderr and exits non-zero, with the
traceback only under `-v`; anything else is a bug and keeps its traceback. This module imports
nothing, so every layer of the package can raise these.
"""

from __future__ import annotations


class RLCoreError(Exception):
    """A problem the message fully explains (it names the config key, file, row or field), so a
    traceback would only hide it."""


__all__ = ["RLCoreError"]
