"""Host / Origin checks when no API key is set: a web page in the operator's browser must not read
prompt text from this server, run inference on it, or post to its admin routes.

Without a key, anything that can reach the port may call it, a page in the operator's browser included:
a DNS-rebinding page (its name resolves to 127.0.0.1, so the browser treats this server as the page's
own origin and lets it read every answer) or a cross-site form POST (no CORS preflight). So, without a
key, every route but /health and /metrics (the ones a key leaves open too) is answered 403 unless:

* its Host names this server: a loopback name or address, any IP address (a rebinding page always has
  a name; a page at an IP address's origin is this server's own), the address given to --host, or one
  of --allowed-hosts (`*` allows any); and
* for a request that is not a GET / HEAD / OPTIONS, its Origin, if it sends one, is such a host too or
  one of --allowed-origins (a `Sec-Fetch-Site: cross-site` request counts as cross-origin).

With a key, the key is the check: a cross-site page cannot send the Authorization header without a CORS
preflight the server does not grant. The inspector page's own headers (no framing) are in
server/ui/route.py.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from swaserve.server.errors import APIError, send_error
from swaserve.server.http.auth import OPEN_PATHS

_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def _hostname(host: str) -> str:
    """`[::1]:1919` -> `::1`, `LocalHost:80` -> `localhost`, `Example.com.` -> `example.com`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".") if host.count(":") == 0 else host


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AdminGuard:
    """Pure ASGI middleware for a server without an API key (see the module docstring)."""

    def __init__(self, app: Any, allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {_hostname(h) for h in allowed_hosts if h != "*"}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def host_allowed(self, name: str) -> bool:
        return self.any_host or is_loopback_name(name) or _is_ip(name) or name in self.hosts

    def refusal(self, headers: dict[bytes, bytes], method: str = "POST") -> APIError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if host and not self.host_allowed(_hostname(host)):  # browsers always send a Host
            return APIError(403, f"Host {host!r} is not allowed without an API key (start the server with "
                            "--allowed-hosts NAME, or with --api-key)", None, "host_not_allowed",
                            "permission_error")
        if method in _SAFE_METHODS:
            return None
        origin = headers.get(b"origin", b"").decode("latin-1").strip()
        cross_site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower() == "cross-site"
        if not origin and not cross_site:
            return None  # not sent by a browser page (curl, SDKs) or a same-origin navigation
        if origin and (origin.rstrip("/").lower() in self.origins or "*" in self.origins):
            return None
        name = _hostname(urlsplit(origin).netloc) if origin and origin != "null" else ""
        if name and self.host_allowed(name) and not cross_site:
            return None
        return APIError(403, "cross-origin request refused without an API key (--allowed-origins)", None,
                        "cross_origin", "permission_error")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            err = self.refusal(dict(scope.get("headers", ())), scope["method"])
            if err is not None:
                await send_error(send, err)
                return
        await self.app(scope, receive, send)
