"""POST /v1/embeddings: this server runs a generative model (Gemma 4) and serves no embeddings. The
route exists so that a client gets an OpenAI error envelope saying so (404, `code:
model_does_not_support_embeddings`, `param: model`) after its body is checked like any other (a bad body
is a 400 naming the field, another model a 404), instead of a bare 404 for an unknown path."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from swaserve.server.body import json_body
from swaserve.server.errors import APIError
from swaserve.server.protocol import RequestBody
from swaserve.server.state import ServerState

router = APIRouter()


class EmbeddingRequest(RequestBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


@router.post("/v1/embeddings")
async def embeddings(body: Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))],
                     request: Request) -> Response:
    state: ServerState = request.app.state.swa
    model = state.check_model(body.model)  # 503 while loading, 404 for another model
    raise APIError(404, f"The model `{model}` does not support embeddings: this server runs a generative "
                   "model (Gemma 4) and serves chat, completions and responses only", "model",
                   "model_does_not_support_embeddings")


