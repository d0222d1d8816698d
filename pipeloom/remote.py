"""The client side of ``pipeloom serve``, standard library only: read a URL with a time and size
limit (``load_plan("http://...")``), and ask a server for a plan (``pipeloom plan --server``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from pipeloom.errors import PipeloomError

__all__ = ["MAX_RESPONSE_BYTES", "TIMEOUT_SECONDS", "is_url", "post_json", "read_url"]

MAX_RESPONSE_BYTES = 64 * 2**20
"""Largest answer read from a server (a plan's schedule file of a large pipeline is a few MB)."""
TIMEOUT_SECONDS = 60.0
"""Seconds to wait for a server to connect and answer."""


def is_url(text: object) -> bool:
    """Whether ``text`` is an ``http://`` or ``https://`` URL (a plan given by its server address)."""
    return isinstance(text, str) and urlsplit(text).scheme in ("http", "https")


def _open(request: urllib.request.Request, *, timeout: float, limit: int) -> str:
    url = request.full_url
    if not is_url(url):
        raise PipeloomError(f"{url!r} is not an http:// or https:// URL")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 (scheme checked above)
            body = answer.read(limit + 1)
    except urllib.error.HTTPError as error:
        raise PipeloomError(f"{url}: the server answered {error.code}: {_message(error)}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise PipeloomError(f"{url}: cannot reach the server ({reason}); is `pipeloom serve` running there?") from None
    if len(body) > limit:
        raise PipeloomError(f"{url}: the answer is larger than {limit:,} bytes; refusing it")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise PipeloomError(f"{url}: the answer is not UTF-8 text") from None


def _message(error: urllib.error.HTTPError) -> str:
    """The server's one-line ``{"error": ...}``, or the HTTP reason."""
    try:
        return str(json.loads(error.read(64 * 1024).decode("utf-8"))["error"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError):
        return str(error.reason)


def read_url(url: str, *, timeout: float = TIMEOUT_SECONDS, limit: int = MAX_RESPONSE_BYTES) -> str:
    """The text at ``url`` (GET), refused past ``timeout`` seconds or ``limit`` bytes."""
    return _open(urllib.request.Request(url, headers={"Accept": "application/json"}), timeout=timeout, limit=limit)


def post_json(url: str, document: dict, *, timeout: float = TIMEOUT_SECONDS, limit: int = MAX_RESPONSE_BYTES) -> dict:
    """POST ``document`` as JSON to ``url``; the JSON object answered."""
    data = json.dumps(document).encode("utf-8")
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    text = _open(request, timeout=timeout, limit=limit)
    try:
        answer = json.loads(text)
    except ValueError:
        raise PipeloomError(f"{url}: the server's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise PipeloomError(f"{url}: expected a JSON object, got {type(answer).__name__}")
    return answer
