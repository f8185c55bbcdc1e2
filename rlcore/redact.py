"""The one redaction policy for everything a person or a server can read: log records (every
logger's, Prefect's included: `install_log_redaction`), console output and error messages, the run
folder's `config.yaml` and `trace.jsonl`, `rlcore trace`, MLflow params and tags, lineage records,
webhook payloads, Prefect flow-run parameters (`rlcore.lifecycle.flow_secrets`) and the messages
of failed Prefect tasks and flows (`redacts_errors`).

What is recognised as a secret:

- a value under a secret key (`registry.webhook_url`, any key ending in `password`, `secret`,
  `token`, `api_key`, `credentials`...): the whole value is a credential (a Slack or Discord webhook
  carries its token in the path), so only a URL's scheme and host survive (`redact_secret`);
- a credential inside any URL in any text: the userinfo (`user:pass@`), every query value
  (`?token=...`, `X-Amz-Signature=...`) and the fragment (`#access_token=...`; not a web app's
  route such as MLflow's `#/experiments/1`) are replaced; the rest is kept so the reader still
  sees where it points (`redact_url`);
- the value of an environment variable whose name marks a secret (`*_TOKEN`, `*_API_KEY`,
  `*_SECRET`, `*SECRET_*`, `*PASSWORD*`, `*_ACCESS_KEY`, `*_PRIVATE_KEY`, `*WEBHOOK_URL`: `HF_TOKEN`,
  `OPENAI_API_KEY`, `AWS_SECRET_ACCESS_KEY`, `MLFLOW_TRACKING_PASSWORD`, `DATABRICKS_TOKEN`,
  `RLCORE_WEBHOOK_URL`...), read from the environment each time, wherever it appears; values
  shorter than `MIN_ENV_SECRET_CHARS` are left alone (a `*_TOKEN=1` must not redact every "1");
- common key formats: OpenAI and Anthropic keys (`sk-...`, `sk-ant-...`), GitHub tokens (`ghp_`,
  `gho_`, `ghu_`, `ghs_`, `ghr_`, `github_pat_`), Slack tokens (`xoxb-`...), AWS access key ids
  (`AKIA...`, `ASIA...`), Google API keys (`AIza...`), Hugging Face tokens (`hf_...`), JWTs
  (`eyJ...eyJ...`), the token after `Bearer` and after `Authorization: Basic`, PEM private key
  blocks, and the value in `password=...`, `"api_key": "..."` and the like.

Each is replaced by `***` (a key's name, `Bearer ` and a URL's host are kept). Text without a
secret is returned unchanged, byte for byte: strings are edited in place, never re-serialised.
The formats are matched with lookalikes in mind: ordinary words, numbers, UUIDs, hex digests and
file paths are not secrets (a random key mixes cases and digits; a word after `Bearer` does not).

The raw value stays in the in-memory config; only the code that must use it (the webhook POST)
reads it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["MIN_ENV_SECRET_CHARS", "REDACTED", "env_secrets", "install_log_redaction", "is_secret_env_name",
           "is_secret_key", "redact_exception", "redact_json", "redact_params", "redact_secret", "redact_text",
           "redact_tree", "redact_url", "redacts_errors"]

REDACTED = "***"
MIN_ENV_SECRET_CHARS = 8

# The words that end the name of a secret (a config key, an argument, `password=` in a text).
SECRET_WORDS = r"password|passwd|pwd|secret|token|api[_-]?key|credentials?|private_?key|webhook_url|signature"
# Matched against the last segment of a dotted key, case-insensitively.
SECRET_KEY = re.compile(rf"(?:^|[_-])(?:{SECRET_WORDS})$", re.IGNORECASE)
# Tokenizer settings, not credentials.
SPECIAL_TOKEN = re.compile(r"(?:^|_)(?:pad|eos|bos|unk|sep|cls|mask)_token$", re.IGNORECASE)
# Environment variables holding secrets (`GOOGLE_APPLICATION_CREDENTIALS` is a file's path: not one).
SECRET_ENV_NAME = re.compile(
    r"(?:^|_)(?:TOKEN|SECRET|API_?KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY|PASSPHRASE|WEBHOOK(?:_URL)?)$"
    r"|PASSWORD|PASSWD|(?:^|_)SECRET_", re.IGNORECASE)
# scheme://authority path ?query #fragment, as RFC 3986 splits them.
URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<authority>[^/?#]*)(?P<path>[^?#]*)"
                 r"(?:\?(?P<query>[^#]*))?(?:#(?P<fragment>.*))?$", re.DOTALL)
# A URL inside free text ends at whitespace, quotes or angle brackets.
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
URL_TRAILING_PUNCTUATION = ".,;:!?)]}"  # after a URL in prose: the sentence's, not the URL's
# A PEM private key block (to the end of the text when cut before its END line).
PEM_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
                             re.DOTALL)
# Key formats, each found only in a text holding one of its hints (a substring test, much faster
# than a regex over every log line): (name, hints, pattern); a pattern's group `head` is kept, its
# group `secret` replaced, when `_FORMAT_CHECKS[name]` (if any) finds it is not a lookalike.
_B = r"(?<![A-Za-z0-9_\-])"  # not inside a longer word or identifier
KEY_FORMATS: tuple[tuple[str, tuple[str, ...], re.Pattern[str]], ...] = tuple(
    (name, hints, re.compile(pattern)) for name, hints, pattern in (
        ("openai", ("sk-",), rf"{_B}(?P<secret>sk-(?:ant-|proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{{20,}})"),
        ("github", ("gh", "github_pat_"), rf"{_B}(?P<secret>gh[pousr]_[A-Za-z0-9]{{36,}}|github_pat_[A-Za-z0-9_]{{22,}})"),
        ("slack", ("xox",), rf"{_B}(?P<secret>xox[bpars]-[A-Za-z0-9\-]{{10,}})"),
        ("aws", ("AKIA", "ASIA"), r"(?<![A-Za-z0-9])(?P<secret>(?:AKIA|ASIA)[A-Z0-9]{16})(?![A-Za-z0-9])"),
        ("google", ("AIza",), rf"{_B}(?P<secret>AIza[0-9A-Za-z_\-]{{35,}})"),
        ("huggingface", ("hf_",), rf"{_B}(?P<secret>hf_[A-Za-z0-9]{{30,}})"),
        ("jwt", ("eyJ",), rf"{_B}(?P<secret>eyJ[A-Za-z0-9_\-]{{5,}}\.eyJ[A-Za-z0-9_\-]{{5,}}\.[A-Za-z0-9_\-]*)"),
        ("bearer", ("earer",), r"(?P<head>\b[Bb]earer\s+)(?P<secret>[A-Za-z0-9._~+/\-]{16,}=*)"),
        ("basic", ("Basic",), r"(?P<head>\bAuthorization[\"']?\s*[:=]\s*[\"']?Basic\s+)(?P<secret>[A-Za-z0-9+/]{8,}={0,2})"),
        # `password=...`, `"api_key": "..."`, `token: ...`: found by the word that ends the key, the
        # whole key (read back from there) judged by `is_secret_key`
        ("assign", (), rf"(?i:(?P<word>{SECRET_WORDS}))(?P<head>[\"']?\s*[:=]\s*[\"']?)"
                       r"(?P<secret>[^\s\"',;&}\]\)]{4,})"),
    ))
# The assignment format's hints, looked for in the lower-cased text.
_ASSIGN_HINTS = ("pass", "pwd", "secret", "token", "key", "credential", "signature", "webhook")
# The characters of a key name, read back from the secret word that ends it.
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def is_secret_key(key: str) -> bool:
    """Whether a (dotted) config key names a secret value, judged by its last segment."""
    last = key.rsplit(".", 1)[-1]
    return bool(SECRET_KEY.search(last)) and not SPECIAL_TOKEN.search(last)


def is_secret_env_name(name: str) -> bool:
    """Whether an environment variable's name marks its value as a secret (`HF_TOKEN`, ...)."""
    return bool(SECRET_ENV_NAME.search(name))


_env_name_verdicts: dict[Any, bool] = {}


def env_secrets() -> list[str]:
    """The values (of at least `MIN_ENV_SECRET_CHARS`) of this process's environment variables whose
    names mark secrets, longest first, as the environment is now. (CPython's `os.environ._data`
    read directly: decoding every variable through `os.environ` takes ten times as long, and this
    runs for every log record.)"""
    data = getattr(os.environ, "_data", None)
    items = data.items() if isinstance(data, dict) else os.environ.items()
    found = []
    for name, value in items:
        verdict = _env_name_verdicts.get(name)
        if verdict is None:
            verdict = _env_name_verdicts[name] = is_secret_env_name(os.fsdecode(name))
        if verdict and len(value) >= MIN_ENV_SECRET_CHARS:
            found.append(os.fsdecode(value))
    return sorted(set(found), key=len, reverse=True)


def redact_url(url: str) -> str:
    """`url` with its userinfo, query values and fragment (unless a web app's route, `#/...`)
    replaced by `***`; anything else kept.

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
    if m["fragment"] is not None:  # (`#access_token=...`); a web app's route (`#/experiments/1`) is kept
        out += "#" + _redact_fragment(m["fragment"])
    return out


def _redact_fragment(fragment: str) -> str:
    """A URL's fragment as it may be shown: a web app's route (`/models/m/versions/1?workflowType=x`,
    MLflow's UI links) kept, the values of its secret-named parameters (`?token=...`) redacted;
    anything else (`access_token=...` of an OAuth redirect, or a page's anchor: a fragment that is
    not a route cannot be told from a token) redacted whole."""
    if not fragment:
        return ""
    if not fragment.startswith("/"):
        return REDACTED
    route, q, query = fragment.partition("?")
    if not q:
        return route
    params = [f"{k}={REDACTED}" if eq and is_secret_key(k) else f"{k}{eq}{v}"
              for k, eq, v in (p.partition("=") for p in query.split("&"))]
    return f"{route}?{'&'.join(params)}"


def _redact_url_in_text(m: re.Match[str]) -> str:
    """A URL found in prose, redacted without the punctuation that ends its sentence or clause
    (`...?token=abc:` keeps its colon, and redacting the result again changes nothing)."""
    url = m.group(0)
    core = url.rstrip(URL_TRAILING_PUNCTUATION)
    return redact_url(core) + url[len(core):]


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


def _mixed(s: str, digits: bool = True) -> bool:
    """Whether `s` mixes upper and lower case letters (and digits): a random key does, a word or
    a path rarely."""
    return any(c.isupper() for c in s) and any(c.islower() for c in s) and (not digits or any(c.isdigit() for c in s))


def _word_and_digit(s: str) -> bool:
    return any(c.isdigit() for c in s) and any(c.isalpha() for c in s)


def _random_token(s: str) -> bool:
    """Long enough and mixed enough to be a credential rather than a word or a number."""
    return len(s) >= MIN_ENV_SECRET_CHARS and (_word_and_digit(s) or _mixed(s, digits=False))


# Lookalike checks per format (a format not named here is distinctive enough as matched).
_FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "openai": _mixed,
    "huggingface": lambda s: _mixed(s[3:], digits=False),
    "aws": lambda s: s.startswith("AKIA") or any(c.isdigit() for c in s[4:]),
    "bearer": lambda s: _word_and_digit(s) or _mixed(s, digits=False) and len(s) >= 24,
    "assign": lambda s: not s.startswith(REDACTED) and not s.replace(".", "").replace("-", "").isdigit(),
}


def _assigned_key(m: re.Match[str]) -> str:
    """The whole key name that the secret word of an `assign` match ends."""
    start = m.start()
    while start > 0 and m.string[start - 1] in _KEY_CHARS:
        start -= 1
    return m.string[start:m.end("word")]


def _redactor(name: str) -> Callable[[re.Match[str]], str]:
    """The replacement for one key format's matches: its `head` kept and `secret` replaced, or the
    match as it is when it is a lookalike."""
    check = _FORMAT_CHECKS.get(name)

    def replace(m: re.Match[str]) -> str:
        if name == "assign":
            key = _assigned_key(m)
            # a bare `token` is as often a model's token (`token: <|im_end|>`) as a credential
            if not is_secret_key(key) or key.rsplit(".", 1)[-1].lower() == "token" and not _random_token(m["secret"]):
                return m.group(0)
        if check is not None and not check(m["secret"]):
            return m.group(0)
        return m.group(0)[:m.start("secret") - m.start()] + REDACTED

    return replace


_REDACTORS = {name: _redactor(name) for name, _, _ in KEY_FORMATS}


def redact_text(text: str) -> str:
    """`text` with every secret the policy recognises (the module's doc) replaced: the values of
    secret environment variables, PEM private keys, credentials in URLs, key formats. For log
    lines, error messages, trace texts and any other free text."""
    for secret in env_secrets():
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "PRIVATE KEY-----" in text:
        text = PEM_PRIVATE_KEY.sub(REDACTED, text)
    if "://" in text:
        text = URL_IN_TEXT.sub(_redact_url_in_text, text)
    lower = None
    for name, hints, pattern in KEY_FORMATS:
        if hints:
            if not any(h in text for h in hints):
                continue
        else:
            lower = text.lower() if lower is None else lower
            if not any(h in lower for h in _ASSIGN_HINTS):
                continue
        text = pattern.sub(_REDACTORS[name], text)
    return text


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
    values under secret keys, and secrets in every string (`redact_text`)."""
    return {k: _redact_value(f"{prefix}{k}", v) for k, v in tree.items()}


def redact_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Flat `{"dotted.key": value}` params or tags, redacted as `redact_tree` does."""
    return {k: _redact_value(k, v) for k, v in params.items()}


def redact_json(value: Any) -> Any:
    """Any JSON-like value (a trace record, a notification) with secrets redacted as `redact_tree`
    does: mappings' values under secret keys whole, every string through `redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return redact_tree({str(k): v for k, v in value.items()}) if value else {}
    if isinstance(value, (list, tuple)):
        return [redact_json(v) for v in value]
    return value


# ---------------------------------------------------------------------- errors
def redact_exception(err: BaseException) -> BaseException:
    """`err` with the secrets in its message redacted in place (its args, an OSError's file names,
    its notes), its type and traceback kept: whoever catches it (an exit status by type) sees the
    same error, and whatever shows or stores its message (Prefect keeps a failed run's) no secret.
    An exception whose message is not its args (a custom `__str__`) keeps what its args do not hold."""
    try:
        err.args = tuple(redact_text(a) if isinstance(a, str) else a for a in err.args)
        for name in ("filename", "filename2"):
            value = getattr(err, name, None)
            if isinstance(value, str):
                setattr(err, name, redact_text(value))
        notes = getattr(err, "__notes__", None)
        if isinstance(notes, list):
            err.__notes__ = [redact_text(n) if isinstance(n, str) else n for n in notes]
    except Exception:  # noqa: BLE001 - read-only attributes: the error itself matters more than its redaction
        pass
    return err


F = TypeVar("F", bound=Callable[..., Any])


def redacts_errors(fn: F) -> F:
    """`fn`, whose exceptions leave it with their messages redacted (`redact_exception`); its
    signature and annotations kept (Prefect reads a flow's parameters from them)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise redact_exception(err)  # noqa: B904 - the same exception, not a new one

    wrapper.rlcore_redacts_errors = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------- log records
def _redacted_record(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with secrets out of its message and traceback (changed only where one was found:
    handlers and filters see the record as made otherwise)."""
    try:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            shown = redact_text(text)
            if shown != text:
                record.exc_text = shown  # what Formatter.format prints instead of formatting exc_info again
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
    except Exception:  # noqa: BLE001 - a bad format string or __str__: the handler reports it as it would
        pass
    return record


def install_log_redaction() -> None:
    """Redact every log record this process makes, whoever logs it and wherever it goes (rlcore's
    console, Prefect's console and its API log handler, pytest's capture, files), by wrapping the
    log record factory: one place, before any handler or filter sees the record, so no handler
    added later (Prefect configures its own) can miss it. Idempotent."""
    current = logging.getLogRecordFactory()
    if getattr(current, "rlcore_redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _redacted_record(current(*args, **kwargs))

    factory.rlcore_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
