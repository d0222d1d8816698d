"""The ASGI guard in front of ``pipeloom serve``'s routes: only this server's own names as Host (a DNS-rebinding
page names another), no request from another site (Origin, Sec-Fetch-Site), a bounded number of requests in
progress, and headers that keep answers from being sniffed, framed or read by other sites. A refusal is a
one-line JSON answer that closes the connection (its body, if any, is never read), and so is any answer
sent before the request's body was read to its end (a 413, a 415, a 404 with a body): uvicorn would
otherwise read the rest of the body, however long, and drop it."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from pipeloom.serve.config import ServeConfig

__all__ = ["SECURITY_HEADERS", "Guard", "host_names", "own_url"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
"""Headers on every answer: no MIME sniffing, never in a frame, no Referer sent on, not readable by other
sites' pages (each answer without a Content-Security-Policy also gets ``default-src 'none'; frame-ancestors
'none'``)."""

_API_POLICY = b"default-src 'none'; frame-ancestors 'none'"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def host_names(config: ServeConfig) -> frozenset[str] | None:
    """The names the server answers to (lower case, no port; None: any, for ``allowed_hosts=("*",)``): the bound
    address; for a loopback or wildcard bind, ``localhost``, 127.0.0.1 and ::1; for a wildcard bind, this
    machine's host names; and ``config.allowed_hosts``. The address a connection arrived on is allowed too
    (:class:`Guard`)."""
    if "*" in config.allowed_hosts:
        return None
    names = {config.host.lower().strip("[]"), *(name.lower() for name in config.allowed_hosts)}
    wildcard = config.host in ("", "0.0.0.0", "::")
    try:
        loopback = ipaddress.ip_address(config.host.strip("[]")).is_loopback
    except ValueError:
        loopback = config.host.lower() == "localhost"
    if loopback or wildcard:
        names.update(_LOOPBACK)
    if wildcard:
        names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
    return frozenset(names)


def _hostname(authority: str) -> str:
    """``host`` of ``host:port`` or ``[v6]:port``, lower case."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


def own_url(scope: Scope) -> str:
    """This server's base URL from the address the connection arrived on (never from the client's Host)."""
    host, port = scope.get("server") or ("127.0.0.1", None)
    host = f"[{host}]" if ":" in host else host
    return f"{scope.get('scheme', 'http')}://{host}" + (f":{port}" if port else "")


class Guard:
    """ASGI middleware: the checks and headers of this module's doc, then ``app``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], config: ServeConfig) -> None:
        self.app, self.config, self.names = app, config, host_names(config)
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        if self.in_progress >= self.config.max_requests:
            await _refuse(send, 503, f"{self.in_progress} requests are in progress, this server's limit; try again "
                                     "later")
            return
        self.in_progress += 1
        headers = dict(scope["headers"])
        unread = [headers.get(b"content-length", b"0") not in (b"", b"0") or b"transfer-encoding" in headers]

        async def receiving() -> MutableMapping[str, Any]:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread[0] = False
            return message

        try:
            await self.app(scope, receiving, _with_headers(send, unread))
        finally:
            self.in_progress -= 1

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why ``scope`` is refused (status, one line), or None."""
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        authority = headers.get("host", "")
        own = (scope.get("server") or ("",))[0].lower()
        if self.names is not None and _hostname(authority) not in self.names | {own}:
            return 421, (f"this server does not answer to the host {authority[:80]!r}; it serves "
                         f"{', '.join(sorted(self.names))} (pipeloom serve --allow-host NAME adds one)")
        origin = headers.get("origin")
        if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != authority.lower()):
            return 403, f"requests from another site ({origin[:80]}) are refused; use the page this server serves"
        site = headers.get("sec-fetch-site", "none")
        navigation = scope["method"] == "GET" and scope["path"] == "/" and headers.get("sec-fetch-mode") == "navigate"
        if site not in ("same-origin", "none") and not navigation:
            return 403, f"requests from another site (Sec-Fetch-Site: {site[:20]}) are refused"
        return None


def _with_headers(send: Send, unread: list[bool]) -> Send:
    """``send`` adding :data:`SECURITY_HEADERS` (and a restrictive policy where the answer has none), and
    ``Connection: close`` when the request's body is not read to its end (``unread[0]``)."""

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in (b"server", b"connection")
                       or (k.lower() == b"connection" and not unread[0])]
            if not any(k.lower() == b"content-security-policy" for k, _ in headers):
                headers.append((b"content-security-policy", _API_POLICY))
            if unread[0]:
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers + list(SECURITY_HEADERS)}
        await send(message)

    return sending


async def _refuse(send: Send, status: int, message: str) -> None:
    """A one-line JSON refusal that closes the connection (the request's body is never read)."""
    body = json.dumps({"error": message}).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), (b"content-security-policy", _API_POLICY), *SECURITY_HEADERS]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
