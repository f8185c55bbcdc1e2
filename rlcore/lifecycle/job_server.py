"""A Ray cluster's job server (`--ray-address`, the flow's `ray_address`): its URL checked before
anything is sent to it, reached within a stated time, never shown with its credentials.

`job_server_url` refuses what is not a job server URL in one line, without touching the network
(an empty address, a `ray://` client address, a Unix path, a bad port, spaces, non-ASCII, a query
that Ray would append its API paths to...). `connect` then resolves the host and opens a TCP
connection, each bounded (`TIMEOUT_S`), before Ray's `JobSubmissionClient` is built (its own
requests have no timeout: a name that resolves slowly or a host that drops packets held it for
over two minutes), and bounds that too. Every message shows the address through
`rlcore.redact.redact_url`: `http://***@head:8265`, never the password or a query token.
Stdlib only until the client is built: the CLI refuses a bad address in milliseconds.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from rlcore.errors import RLCoreError
from rlcore.redact import REDACTED, redact_text, redact_url

__all__ = ["MAX_LENGTH", "TIMEOUT_S", "JobServerAddressError", "JobServerUnreachable", "connect", "job_server_url",
           "probe", "shown"]

TIMEOUT_S = 5.0  # each of: resolving the host, connecting to it, Ray's client's first answer
MAX_LENGTH = 2048  # no job server URL is longer; a longer one is refused before it is parsed
SCHEMES = ("http", "https")
EXAMPLE = "http://HEAD:8265 (the head node's dashboard port)"
# a DNS name: dot-separated labels of letters, digits, '-' (and '_', which some private names use)
HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
T = TypeVar("T")


class JobServerAddressError(RLCoreError, ValueError):
    """The address is not a job server URL (nothing was sent anywhere)."""


class JobServerUnreachable(RLCoreError, ConnectionError):
    """No Ray job server answered at the address within the bound."""


def shown(address: str, limit: int = 120) -> str:
    """`address` as a message may show it: credentials, query values and fragment redacted,
    control and non-ASCII characters escaped, cut to `limit` characters. Everything before the last
    `@` counts as credentials and everything after the first `?` or `#` as query, even where a URL
    parser would read them otherwise (`http://u:p#w@h`, `host?token=...` with no scheme)."""
    head, at, tail = address.rpartition("@")
    text = f"{head[:head.index('://') + 3] if '://' in head else ''}{REDACTED}@{tail}" if at else address
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut] + redact_url("http://h" + text[cut:])[len("http://h"):]
    text = redact_text(text).encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(address)} characters)"


def job_server_url(address: str) -> str:
    """The job server's URL for `address`: `http(s)://HOST[:PORT][/PATH]` as given, or `http://`
    added to a bare `HOST:PORT`. Raises JobServerAddressError naming what is wrong."""
    if not isinstance(address, str):
        raise JobServerAddressError(f"must be a URL string, got {type(address).__name__}")
    if not address.strip():
        raise JobServerAddressError(f"is empty: give the cluster's job server, {EXAMPLE} (leave it out to run every "
                                    "stage in this process)")
    if len(address) > MAX_LENGTH:
        raise JobServerAddressError(f"is {len(address)} characters long (a job server URL has at most {MAX_LENGTH}): "
                                    f"{shown(address, 60)}")
    odd = next((c for c in address if not c.isascii() or not c.isprintable() or c.isspace()), None)
    if odd is not None:
        what = "a space" if odd == " " else f"the character {odd!r} (U+{ord(odd):04X})"
        hint = "; write a non-ASCII host name in its ASCII form (xn--...)" if not odd.isascii() else ""
        raise JobServerAddressError(f"{shown(address)} holds {what}{hint}; give {EXAMPLE}")
    if address.startswith(("/", ".", "~")):
        raise JobServerAddressError(f"{shown(address)} is a path; the pipeline reaches a job server over HTTP: {EXAMPLE}")
    scheme = address.split("://", 1)[0].lower() if "://" in address else None
    if scheme == "ray":
        raise JobServerAddressError(f"{shown(address)} is a Ray Client address (ray://); the pipeline submits jobs to "
                                    f"the cluster's job server: {EXAMPLE}")
    if scheme is not None and scheme not in SCHEMES:
        raise JobServerAddressError(f"{shown(address)}: scheme {scheme!r} is not a job server's (http:// or https://); "
                                    f"give {EXAMPLE}")
    url = f"{scheme}://{address.split('://', 1)[1]}" if scheme else f"http://{address}"  # Ray reads the scheme as given
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:  # a port that is not a number in 0-65535, an unclosed [IPv6 literal
        raise JobServerAddressError(f"{shown(address)}: {_unparsable(err)}; give {EXAMPLE}") from None
    _check_host(address, parts)
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise JobServerAddressError(f"{shown(address)}: {'port 0' if port == 0 else 'an empty port'} is not a port "
                                    f"(1-65535); give {EXAMPLE}")
    if scheme is None and port is None:
        raise JobServerAddressError(f"{shown(address)} has no port; give {EXAMPLE}")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise JobServerAddressError(f"{shown(address)}: a job server URL has no query or fragment (Ray appends its API "
                                    f"paths to it); give {EXAMPLE}")
    return url.rstrip("/")


def _unparsable(err: ValueError) -> str:
    """urllib's refusal of a URL in words that name the part."""
    text = str(err)
    if "could not be cast" in text:
        return "the port is not a number"
    if "out of range" in text:
        return "the port is out of range (1-65535)"
    if "IPv6" in text:
        return "an IPv6 address must be written in closed brackets, [::1]:8265"
    return "it is not a well-formed URL"


def _check_host(address: str, parts: SplitResult) -> None:
    host = parts.hostname
    if not host:
        raise JobServerAddressError(f"{shown(address)} names no host; give {EXAMPLE}")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(HOST_LABEL.fullmatch(label) for label in labels):
        raise JobServerAddressError(f"{shown(address)}: {shown(host, 60)!r} is not a host name or IP address; "
                                    f"give {EXAMPLE}")


def _within(seconds: float, what: str, fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread, waited for at most `seconds` (a call with no timeout of its own,
    such as `getaddrinfo` or Ray's client, is abandoned there, not waited for)."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=call, name=f"job-server-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} took longer than {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def probe(url: str, timeout_s: float = TIMEOUT_S) -> None:
    """Resolve the job server's host and open a TCP connection to it, each within `timeout_s`.
    Raises JobServerUnreachable saying which step failed."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    where = shown(url)
    try:
        infos = _within(timeout_s, "resolving the host", lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except TimeoutError:
        raise JobServerUnreachable(f"{where}: the host name {host!r} did not resolve within {timeout_s:g} s") from None
    except (socket.gaierror, UnicodeError) as err:
        raise JobServerUnreachable(f"{where}: the host name {host!r} does not resolve ({err})") from None
    deadline = time.monotonic() + timeout_s
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(sockaddr)
            return
        except TimeoutError:
            errors.append(f"no answer from {sockaddr[0]} within {timeout_s:g} s")
        except OSError as err:
            errors.append(f"{sockaddr[0]}: {err.strerror or err}")
    raise JobServerUnreachable(f"{where}: nothing accepts connections on port {port} ({'; '.join(errors) or 'no address'})")


def connect(address: str, timeout_s: float = TIMEOUT_S) -> Any:
    """Ray's `JobSubmissionClient` for the job server at `address`, reached within 3 x `timeout_s`
    (resolve, connect, Ray's version check). Raises JobServerAddressError or JobServerUnreachable."""
    url = job_server_url(address)
    probe(url, timeout_s)

    from ray.job_submission import JobSubmissionClient  # outside the bound: importing Ray takes seconds when loaded

    try:
        return _within(timeout_s, "Ray's job client", lambda: JobSubmissionClient(url))
    except TimeoutError:
        raise JobServerUnreachable(f"{shown(url)}: connected, but no Ray job server answered within {timeout_s:g} s "
                                   "(is this the dashboard's port?)") from None
    except Exception as err:  # noqa: BLE001 - Ray raises ConnectionError or RuntimeError here
        first = redact_text((str(err).strip().splitlines() or [type(err).__name__])[0]).replace(url, shown(url))
        raise JobServerUnreachable(f"{shown(url)}: no Ray job server answers there ({first})") from None
