"""Redaction of secrets wherever values leave the process: log lines, the run folder's
`config.yaml`, MLflow params and tags, lineage records.

Two kinds of secret are recognised:

- a config value under a secret key (`registry.webhook_url`, any key ending in `password`,
  `secret`, `token`, `api_key`, `credentials`...): the whole value is a credential (a Slack or
  Discord webhook carries its token in the path), so only a URL's scheme and host survive;
- a credential inside any URL in any string: the userinfo (`user:pass@`), every query value
  (`?token=...`, `X-Amz-Signature=...`) and the fragment are replaced; the rest is kept so the
  reader still sees where it points.

The raw value stays in the in-memory config; only the code that must use it (the webhook POST)
reads it. Strings are edited in place rather than re-serialised, so a value without a secret is
returned unchanged, byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_key", "redact_params", "redact_secret", "redact_text", "redact_tree", "redact_url"]

REDACTED = "***"

# Matched against the last segment of a dotted key, case-insensitively.
SECRET_KEY = re.compile(
    r"(?:^|[_-])(?:password|passwd|pwd|secret|token|api_?key|apikey|credentials?|private_?key|webhook_url|signature)$",
    re.IGNORECASE,
)
# Tokenizer settings, not credentials.
SPECIAL_TOKEN = re.compile(r"(?:^|_)(?:pad|eos|bos|unk|sep|cls|mask)_token$", re.IGNORECASE)
# scheme://authority path ?query #fragment, as RFC 3986 splits them.
URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<authority>[^/?#]*)(?P<path>[^?#]*)"
                 r"(?:\?(?P<query>[^#]*))?(?:#(?P<fragment>.*))?$", re.DOTALL)
# A URL inside free text ends at whitespace, quotes or angle brackets.
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def is_secret_key(key: str) -> bool:
    """Whether a (dotted) config key names a secret value, judged by its last segment."""
    last = key.rsplit(".", 1)[-1]
    return bool(SECRET_KEY.search(last)) and not SPECIAL_TOKEN.search(last)


def redact_url(url: str) -> str:
    """`url` with its userinfo, query values and fragment replaced by `***`; anything else kept.

    `https://u:p@host/hook?token=abc&x=1#f` -> `https://***@host/hook?token=***&x=***#***`.
    Not a URL: returned as it is."""
    m = URL.match(url)
    if m is None:
        return url
    authority = m["authority"]
    if "@" in authority:
        authority = f"{REDACTED}@{authority.rsplit('@', 1)[1]}"
    out = m["scheme"] + authority + m["path"]
    if m["query"] is not None:
        parts = [f"{p.split('=', 1)[0]}={REDACTED}" if "=" in p else (REDACTED if p else p) for p in m["query"].split("&")]
        out += "?" + "&".join(parts)
    if m["fragment"] is not None:
        out += "#" + (REDACTED if m["fragment"] else "")
    return out


def redact_secret(value: Any) -> str:
    """A secret value as it may be shown: a URL keeps its scheme and host (`https://host/***`),
    anything else is `***`. Unset (None, or its flattened forms "None", "null", "") stays as it
    is: nothing to hide, and "not set" is worth seeing."""
    if value is None:
        return "None"
    text = str(value)
    if text in ("", "None", "null"):
        return text
    m = URL.match(text)
    if m is None:
        return REDACTED
    host = m["authority"].rsplit("@", 1)[-1]
    return f"{m['scheme']}{host}/{REDACTED}"


def redact_text(text: str) -> str:
    """Every URL inside `text` through `redact_url` (for log lines and error messages)."""
    return URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def _redact_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    if is_secret_key(key):
        return redact_secret(value)
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return redact_tree(value, prefix=f"{key}.")
    if isinstance(value, (list, tuple)):
        return [_redact_value(key, v) for v in value]
    return value


def redact_tree(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of a nested config tree (`config.model_dump(mode="json")`) with secrets redacted:
    values under secret keys, and credentials in URLs anywhere."""
    return {k: _redact_value(f"{prefix}{k}", v) for k, v in tree.items()}


def redact_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Flat `{"dotted.key": value}` params or tags, redacted as `redact_tree` does."""
    return {k: _redact_value(k, v) for k, v in params.items()}
