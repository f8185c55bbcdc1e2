"""What an `rlcore` command prints on its console besides its answer: the `rlcore` loggers' records
(their level from -v, Prefect's console format; the root logger and other libraries' loggers keep
their own configuration), and an unexpected error's traceback with its secrets redacted."""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any, TextIO

from rlcore.redact import redact_text

LOG_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s"  # Prefect's console format


class _RlcoreConsole(logging.StreamHandler[TextIO]):
    """rlcore's log records on the current stderr, unless Prefect's console handler on the root
    logger prints them already (pipeline commands, once Prefect has set up its logging)."""

    def emit(self, record: logging.LogRecord) -> None:
        if any(type(h).__name__ == "PrefectConsoleHandler" for h in logging.getLogger().handlers):
            return
        self.stream = sys.stderr  # the current one (a test's capture, a redirection), not the one at set-up
        super().emit(record)


def configure_logging(verbose: bool) -> None:
    """Level and console output of the `rlcore` loggers only: the root logger, Prefect's and other
    libraries' loggers keep their own configuration (Prefect's format with task names and times)."""
    logger = logging.getLogger("rlcore")
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    for old in [h for h in logger.handlers if isinstance(h, _RlcoreConsole)]:
        logger.removeHandler(old)
    handler = _RlcoreConsole()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)


def redacted_excepthook(kind: type[BaseException], err: BaseException, tb: Any) -> None:
    """An unexpected error's traceback, as Python prints it, with its secrets redacted (rlcore.redact)."""
    print(redact_text("".join(traceback.format_exception(kind, err, tb))), end="", file=sys.stderr)
