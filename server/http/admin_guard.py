"""Host / Origin checks on the state-changing admin routes (`POST /flush_cache`, `/reset_prefix_cache`)
when no API key is set.

Without a key, anything that can reach the port may post to them, a web page in the operator's browser
included: a cross-site form POST (no preflight) or a DNS-rebinding page whose name resolves to 127.0.0.1.
So, without a key, such a request is answered 403 unless its Host names this server (a loopback name or
address, the address given to --host, or one of --allowed-hosts; `*` allows any) and its Origin, if it
sends one, is such a host too or one of --allowed-origins (a `Sec-Fetch-Site: cross-site` request counts
as cross-origin). With a key, the key is the check: a cross-site page cannot send the Authorization header
without a CORS preflight the server does not grant. Inference routes are not guarded: they change no
server state.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

from swaserve.server.errors import APIError

ADMIN_PATHS = ("/flush_cache", "/reset_prefix_cache")
_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def _hostname(host: str) -> str:
    """`[::1]:1919` -> `::1`, `LocalHost:80` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AdminGuard:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app: Any, allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {_hostname(h) for h in allowed_hosts if h != "*"}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def host_allowed(self, name: str) -> bool:
        return self.any_host or is_loopback_name(name) or name in self.hosts

    def refusal(self, headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.host_allowed(_hostname(host)):
            return APIError(403, f"Host {host!r} is not allowed for this admin route without an API key "
                            "(--allowed-hosts)", None, "host_not_allowed", "permission_error")
        origin = headers.get(b"origin", b"").decode("latin-1").strip()
        cross_site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower() == "cross-site"
        if not origin and not cross_site:
            return None  # not sent by a browser page (curl, SDKs) or a same-origin navigation
        if origin and (origin.rstrip("/").lower() in self.origins or "*" in self.origins):
            return None
        name = _hostname(urlsplit(origin).netloc) if origin and origin != "null" else ""
        if name and self.host_allowed(name) and not cross_site:
            return None
        return APIError(403, "cross-origin request refused for this admin route without an API key "
                        "(--allowed-origins)", None, "cross_origin", "permission_error")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in _SAFE_METHODS and scope["path"] in ADMIN_PATHS:
            err = self.refusal(dict(scope.get("headers", ())))
            if err is not None:
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
