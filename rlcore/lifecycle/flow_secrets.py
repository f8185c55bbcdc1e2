"""Secrets kept out of Prefect flow-run parameters, which anyone with access to the Prefect API
reads (`/deployments/filter`, `/flow_runs/filter`, the UI) and which Prefect stores for good.

`sealed(parameters)` gives the parameters to hand to Prefect: every string holding a secret (an
override of a secret key such as `registry.webhook_url=...`, credentials in a URL, an API key, a
secret environment variable's value: `rlcore.redact`'s policy) replaced by its redacted form. The
raw strings go into this process's environment (`RLCORE_FLOW_SECRETS`, a JSON mapping from the
redacted form to the raw string), where the flow finds them: in this process for `pipeline run`,
inherited by the flow-run processes `pipeline serve` starts. `unseal` (the flow, its failure
hooks) puts them back. A run handed a redacted secret that its process was not given (started by
some other worker) is refused, naming the parameter, rather than run with `***` for a secret.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from rlcore.config import WEBHOOK_ENV
from rlcore.errors import RLCoreError
from rlcore.redact import REDACTED, is_secret_key, redact_secret, redact_text

SECRETS_ENV = "RLCORE_FLOW_SECRETS"


class SealedSecretError(RLCoreError, ValueError):
    """A flow-run parameter holds a redacted secret whose value this process was not given."""


def shown(text: str) -> str:
    """A parameter string as Prefect may store it: an override `key=value` of a secret key with its
    value redacted whole (`rlcore.redact.redact_secret`), any other text through `redact_text`."""
    key, eq, value = text.partition("=")
    if eq and is_secret_key(key.strip()):
        return f"{key}={redact_secret(value)}"
    return redact_text(text)


def seal(parameters: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the parameters with every secret-holding string redacted, redacted form -> raw string)."""
    raw_of: dict[str, str] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, str):
            public = shown(value)
            if public != value:
                if raw_of.setdefault(public, value) != value:
                    raise RLCoreError(f"{where}: two different secrets in the pipeline's parameters would both be "
                                      f"stored as {public!r}; give one of them in the config file")
            return public
        if isinstance(value, Mapping):
            return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return {k: walk(v, k) for k, v in parameters.items()}, raw_of


def _given() -> dict[str, str]:
    """The raw strings this process was given (`SECRETS_ENV`)."""
    try:
        found = json.loads(os.environ.get(SECRETS_ENV) or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


@contextlib.contextmanager
def sealed(parameters: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The parameters to hand to Prefect (`seal`), with their raw strings in this process's
    environment until the block ends (processes started meanwhile inherit them)."""
    public, raw_of = seal(parameters)
    before = os.environ.get(SECRETS_ENV)
    if raw_of:
        os.environ[SECRETS_ENV] = json.dumps({**_given(), **raw_of})
    try:
        yield public
    finally:
        if raw_of:
            if before is None:
                os.environ.pop(SECRETS_ENV, None)
            else:
                os.environ[SECRETS_ENV] = before


def unseal(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A flow's `parameters` with each redacted secret `sealed` stored replaced by its raw string;
    a string still holding `***` that this process was not given is refused (SealedSecretError),
    naming the parameter."""
    raw_of = _given()

    def walk(item: Any, at: str) -> Any:
        if isinstance(item, str):
            if item in raw_of:
                return raw_of[item]
            if REDACTED in item:
                raise SealedSecretError(
                    f"{at}: {item!r} is a redacted secret, and this process was not given its value (runs that hold "
                    f"secrets are run by the `rlcore pipeline serve` that deployed them; or give the secret in the "
                    f"config file, the webhook as ${WEBHOOK_ENV})")
            return item
        if isinstance(item, Mapping):
            return {k: walk(v, f"{at}.{k}") for k, v in item.items()}
        if isinstance(item, list):
            return [walk(v, f"{at}[{i}]") for i, v in enumerate(item)]
        return item

    return {k: walk(v, k) for k, v in parameters.items()}
