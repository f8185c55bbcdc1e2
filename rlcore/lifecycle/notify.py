"""Webhook notifications: a JSON POST on promotion, rejection, health stop and failure (pipeline
and `rlcore train`), and when `rlcore train` finishes.

A notification must never fail the pipeline that sends it: errors are logged and reported as
False. No URL configured means no notification (and no network access).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

log = logging.getLogger(__name__)

EVENTS = ("promoted", "rejected", "health_stop", "failed", "finished")


def build_payload(event: str, summary: dict[str, Any]) -> dict[str, Any]:
    if event not in EVENTS:
        raise ValueError(f"unknown notification event {event!r} (expected one of {', '.join(EVENTS)})")
    return {"source": "rlcore", "event": event, "time": time.time(), **summary}


def notify(url: str | None, event: str, summary: dict[str, Any], timeout_s: float = 5.0, retries: int = 1) -> bool:
    """POST `{"source": "rlcore", "event": ..., "time": ..., **summary}` to `url`; True on a 2xx."""
    payload = build_payload(event, summary)
    if not url:
        return False
    data = json.dumps(payload, default=str).encode("utf-8")
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if 200 <= response.status < 300:
                    return True
                log.warning("webhook %s answered %s", url, response.status)
        except (urllib.error.URLError, OSError, ValueError) as err:
            log.warning("webhook %s failed (attempt %d): %s", url, attempt + 1, err)
        if attempt < retries:
            time.sleep(0.5)
    return False
