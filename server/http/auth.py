"""`--api-key`: `Authorization: Bearer <key>` on every route but /health and /metrics (the OpenAPI
document included: it lists every route and field)."""

from __future__ import annotations

import hmac

from fastapi import Request

from swaserve.server.errors import APIError

OPEN_PATHS = ("/health", "/metrics")


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise 401 unless the request carries the configured key (no-op without --api-key)."""
    if api_key is None or request.url.path in OPEN_PATHS:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key (send Authorization: Bearer <key>)", None,
                       "invalid_api_key")
