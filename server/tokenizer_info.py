"""GET /tokenizer_info (vLLM's): the special tokens, the context length and the chat template, for
clients that tokenize through the server (`/tokenize`, `/detokenize`) instead of loading a tokenizer of
their own: lm-evaluation-harness's `local-completions` picks its remote tokenizer when this answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from swaserve.server.errors import APIError
from swaserve.server.state import ServerState

router = APIRouter()


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.swa
    engine = state.ready_engine()
    tok = engine.tokenizer
    pad = tok.pad_id
    try:
        template: str | None = state.chat_template().source
    except APIError:  # no chat template: the field is null
        template = None
    return JSONResponse({
        "tokenizer_class": "GGUF",  # the GGUF's own vocabulary (engine/text/tokenizer.py)
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "pad_token": tok.id_to_piece(pad) if pad is not None else None,
        "model_max_length": engine.context_length, "vocab_size": tok.vocab_size, "chat_template": template,
    })
