"""GET and DELETE /v1/responses/{id}: a stored response (server/responses/store.py), the caller's own
(per API key when the server has keys); an unknown id, or another key's, is a 404 envelope."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from swaserve.server.errors import APIError
from swaserve.server.responses.store import ResponseStore, owner_of
from swaserve.server.state import ServerState

router = APIRouter()


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", "response_id", "response_not_found")


def _store(request: Request) -> tuple[ResponseStore, str]:
    state: ServerState = request.app.state.swa
    return request.app.state.responses, owner_of(request, bool(state.cfg.api_key))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    store, owner = _store(request)
    entry = store.get(owner, response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    store, owner = _store(request)
    if not store.delete(owner, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
