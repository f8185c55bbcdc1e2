"""Webhook notifications: a JSON POST on promotion, rejection, health stop, failure, crash and
cancellation (pipeline; failure also for `rlcore train`), and when `rlcore train` finishes. A pipeline run's
notifications carry an `id` a receiver can drop repeats by ("<flow run id>:failed" for a failed
run, whoever sends it) and, with a Prefect server, `prefect_ui`: the flow run's page. A run whose
process is killed cannot report itself: its `crashed` comes from the process serving it, or from
the Prefect server (rlcore.lifecycle.run_end, rlcore.lifecycle.automations); a run orphaned by the
death of its serving process reports its own.

A notification must never fail the pipeline that sends it: errors are logged and reported as
False. No URL configured means no notification (and no network access). The URL is a secret
(credentials in its userinfo, query or path): it is used for the POST only, and log lines show
it redacted (`rlcore.redact.redact_secret`: scheme and host).
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rlcore.redact import redact_json, redact_secret, redact_text

log = logging.getLogger(__name__)

# `crashed`: the process running a pipeline run died (rlcore.lifecycle.run_end, or the Prefect
# server for a run whose serving process died too: rlcore.lifecycle.automations); `cancelled`: the
# run was cancelled (from the UI/API, or `pipeline serve` stopped by SIGINT/SIGTERM).
EVENTS = ("promoted", "rejected", "health_stop", "failed", "crashed", "cancelled", "finished")


def build_payload(event: str, summary: dict[str, Any]) -> dict[str, Any]:
    if event not in EVENTS:
        raise ValueError(f"unknown notification event {event!r} (expected one of {', '.join(EVENTS)})")
    # what a run reports (an error's message, a path) is redacted like every other output
    return {"source": "rlcore", "event": event, "time": time.time(), **redact_json(summary)}


def request_target(url: str) -> tuple[str, dict[str, str]]:
    """The URL to POST to and its extra headers: credentials in the URL's userinfo
    (`https://user:pass@host/...`) become HTTP Basic authorization, as curl and requests do
    (urllib would take `user:pass@host` for the host name and fail)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, {}
    host = parts.netloc.rsplit("@", 1)[1]
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def notify(url: str | None, event: str, summary: dict[str, Any], timeout_s: float = 5.0, retries: int = 1) -> bool:
    """POST `{"source": "rlcore", "event": ..., "time": ..., **summary}` to `url`; True on a 2xx."""
    payload = build_payload(event, summary)
    if not url:
        return False
    data = json.dumps(payload, default=str).encode("utf-8")
    shown = redact_secret(url)
    try:
        target, auth = request_target(url)
    except ValueError as err:
        log.warning("webhook %s is not a usable URL: %s", shown, redact_text(str(err).replace(url, shown)))
        return False
    headers = {"Content-Type": "application/json", **auth}
    for attempt in range(retries + 1):
        try:
            request = urllib.request.Request(target, data=data, method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if 200 <= response.status < 300:
                    return True
                log.warning("webhook %s answered %s", shown, response.status)
        except (urllib.error.URLError, OSError, ValueError) as err:
            # urllib's messages may quote the URL ("unknown url type: '...'")
            reason = redact_text(str(err).replace(url, shown).replace(target, shown))
            log.warning("webhook %s failed (attempt %d): %s", shown, attempt + 1, reason)
        if attempt < retries:
            time.sleep(0.5)
    return False
