"""GET /v1/models, /health, /metrics; POST /tokenize, /detokenize, /flush_cache."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.server import json_out
from swaserve.server.body import json_body
from swaserve.server.chat import images as chat_images
from swaserve.server.chat import prompt as chat_prompt
from swaserve.server.chat import worker as chat_worker
from swaserve.server.chat.images import ImageParts
from swaserve.server.errors import APIError, bad_request
from swaserve.server.json_out import json_response
from swaserve.server.metrics import CONTENT_TYPE
from swaserve.server.off_loop import run_cpu
from swaserve.server.prompt_limits import check_chars, message_chars
from swaserve.server.prompt_tokens import tokenize_json
from swaserve.server.protocol import DetokenizeRequest, TokenizeRequest
from swaserve.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.swa


@router.get("/health")
async def health(request: Request) -> Response:
    _state(request).ready_engine()  # 503 while loading, after a failed load, while the engine restarts
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "swaserve",
              "root": engine.model_name, "max_model_len": engine.context_length}
             for name in (state.model_name, *state.cfg.served_model_aliases)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    name = state.check_model(model_id)
    return JSONResponse({"id": name, "object": "model", "created": state.created, "owned_by": "swaserve",
                         "root": engine.model_name, "max_model_len": engine.context_length})


@router.post("/tokenize")
async def tokenize(body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
                   request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        plan = chat_prompt.tool_plan(body.tools, None)
        vision = state.vision_setup()
        found = ImageParts() if vision is not None else None
        msgs = await run_cpu(chat_prompt.message_dicts, body.messages, found)  # O(messages): off the loop
        kwargs, add_gen = chat_prompt.template_kwargs(body.chat_template_kwargs, body.add_generation_prompt,
                                                      None)
        if body.continue_final_message:
            add_gen = False
        template = state.chat_template()
        await run_cpu(_check_message_chars, msgs, engine.context_length, template.tokenizer)
        rendered = await chat_worker.render(template, msgs, plan.tools, add_gen, kwargs,
                                            body.continue_final_message)  # in a worker process
        ids, starts = list(rendered.token_ids), list(rendered.message_starts)
        if found is not None and found.parts:  # each image's soft tokens, as a chat request counts them
            assert vision is not None
            prepared = await run_cpu(chat_images.prepare_all, found, vision)
            ids, starts, _ = chat_images.expand(ids, starts, prepared, vision.spec)
        out = {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids,
               "message_starts": starts}
        return await json_response(out)
    assert body.prompt is not None
    tok = engine.tokenizer
    add_bos = body.add_special_tokens and not body.prompt.startswith(tok.id_to_piece(tok.bos_id))
    count, tokens = await tokenize_json(state, tok, body.prompt, add_bos, engine.context_length)
    # the body JSONResponse would send, with the ids' JSON as it came (no list of them in this process)
    head = json_out.dumps({"count": count, "max_model_len": engine.context_length})
    return Response(head[:-1] + b',"tokens":' + tokens + b"}", media_type="application/json")


def _check_message_chars(msgs: list[dict[str, Any]], context_length: int, tok: Tokenizer) -> None:
    check_chars(message_chars(msgs), context_length, tok, "messages")


@router.post("/detokenize")
async def detokenize(body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
                     request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    return JSONResponse({"prompt": await run_cpu(_detokenize, engine.tokenizer, body.tokens)})


def _detokenize(tok: Tokenizer, ids: list[int]) -> str:
    """The ids' text (a worker thread: one pass over a request's ids, however many)."""
    vocab = tok.vocab_size
    if ids and not (0 <= min(ids) and max(ids) < vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})", "tokens")
    return tok.decode(ids, skip_special_tokens=False)


@router.post("/flush_cache")
@router.post("/reset_prefix_cache")
async def flush_cache(request: Request) -> Response:
    engine = _state(request).ready_engine()
    if not await engine.flush_cache():
        raise APIError(400, "cannot flush the cache while requests are running", None, "requests_running")
    return JSONResponse({"status": "ok", "message": "cache flushed"})
