"""Only this machine's pages (and the clients it names) reach the server: a Host allow-list, an Origin check, JSON
bodies for the API. An ASGI middleware over the whole app, the page under it included (`create_app` installs it).

A web page the user visits can send requests to a server on 127.0.0.1: a "simple" cross-site POST (a `text/plain`
body) needs no preflight, and DNS rebinding lets such a page read answers by naming the server under its own domain.
So every request must carry

- a `Host` the server answers to (`HostRules`): localhost and the loopback addresses, the address it is bound to
  (any IP literal when bound to all interfaces: rebinding always uses a name), and `--allowed-hosts` names; a name
  must be listed (`*` lists every name: the check is off);
- no `Origin`, or one whose host is allowed the same way (a browser sends it with every cross-site request);
- a body sent as `application/json`, for the API and the page alike, but for the page's two form posts (`FORMS`:
  gradio's file upload, multipart, and its sign-in form), which the Origin check covers.

A refusal is OpenAI's error shape: 403 `host_not_allowed` / `origin_not_allowed`, 415 `unsupported_media_type`.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from mmadapt.serve.errors import APIError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
FORMS = (("multipart/form-data", "/gradio_api/upload"), ("application/x-www-form-urlencoded", "/login"))
"""(content type, path ending) of the page's form posts: gradio's upload and its sign-in form."""


@dataclass
class HostRules:
    """Which `Host` (and `Origin` host) names a request may use: `allowed` (`--allowed-hosts`; "*" = any) and the
    addresses the server is bound to (`bind`, added by the runner)."""

    allowed: tuple[str, ...] = ()
    bound: set[str] = field(default_factory=set)

    def bind(self, host: str) -> None:
        self.bound.add(_bare(host))

    def allows(self, host: str) -> bool:
        name = _bare(host)
        if "*" in self.allowed or name in LOCAL_NAMES or name in self.bound or name in map(_bare, self.allowed):
            return True
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            return False  # a name that is not listed: what DNS rebinding sends
        return ip.is_loopback or bool(self.bound & WILDCARDS)


def _bare(host: str) -> str:
    """'Example.COM.:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


class Guard:
    """The ASGI middleware: `Guard(app, rules)`; HTTP and websocket requests are checked, lifespan passes."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], rules: HostRules) -> None:
        self.app, self.rules = app, rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            error = self.refusal(scope)
            if error is not None:
                await _send_error(send, error) if scope["type"] == "http" else await send({"type": "websocket.close",
                                                                                          "code": 1008})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if not self.rules.allows(host):
            return APIError(403, f"the Host {host[:100]!r} is not one this server answers to (localhost, the address "
                            "it is bound to): a page under another name cannot use it; start the server with "
                            "--allowed-hosts NAME to answer under NAME", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin != "null":
            origin_host = urllib.parse.urlsplit(origin).netloc
            if not self.rules.allows(origin_host):
                return APIError(403, f"requests from pages of {origin[:100]!r} are refused: only this machine's "
                                "pages and the hosts given with --allowed-hosts may use the server",
                                code="origin_not_allowed")
        elif origin == "null":
            return APIError(403, "requests from an opaque origin (a sandboxed page or a file) are refused",
                            code="origin_not_allowed")
        path = scope.get("path", "")
        if scope.get("method") in BODY_METHODS:
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            form = any(kind == wanted and path.endswith(ending) for wanted, ending in FORMS)
            if kind != "application/json" and not form:
                return APIError(415, f"the body must be sent as application/json, not {kind or 'no type'!r} "
                                "(Content-Type: application/json)", code="unsupported_media_type")
        return None


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
