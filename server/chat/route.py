"""POST /v1/chat/completions (streamed and not)."""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from swaserve.engine.core import RequestOutput
from swaserve.server.chat import legacy_functions as legacy
from swaserve.server.chat.choice import ChatChoice
from swaserve.server.chat.reasoning import ChatOutputParser
from swaserve.server.chat.worker import ChatBody, chat_body
from swaserve.server.errors import bad_request
from swaserve.server.guided import guided
from swaserve.server.leniency import check_fields, report_fields
from swaserve.server.logprobs import TokenText, chat_logprobs
from swaserve.server.off_loop import run_cpu
from swaserve.server.params import build_params
from swaserve.server.prompt_logprobs import engine_prompt_logprobs, format_prompt
from swaserve.server.protocol import ChatCompletionRequest
from swaserve.server.route_ctx import RouteCtx
from swaserve.server.state import ServerState
from swaserve.server.streaming import OutputStream
from swaserve.server.tracking import RequestTracker, tracked
from swaserve.server.usage import usage_dict

router = APIRouter()
logger = logging.getLogger("swaserve.server")


@router.post("/v1/chat/completions")
async def chat_completions(body: Annotated[ChatBody, Depends(chat_body)], request: Request) -> Response:
    state: ServerState = request.app.state.swa
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await tracked(state, rid, lambda tracker: _chat(state, body, request, rid, tracker))


async def _chat(state: ServerState, body: ChatBody, request: Request, rid: str,
                tracker: RequestTracker) -> Response:
    req = body.req
    if body.fields is not None:  # walked in the worker process (server/chat/worker.py)
        report_fields(*body.fields, state.cfg.strict_requests, rid)
    else:
        await run_cpu(check_fields, req, state.cfg.strict_requests, rid)  # walks every message
    engine = state.ready_engine()
    model = state.check_model(req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.audio is not None or "audio" in (req.modalities or []):
        raise bad_request("audio output is not supported (text only)", "audio" if req.audio else "modalities")
    cp = await body.planned(state)  # rendering and tokenizing: in a worker process
    if cp.warning:  # schema keywords a non-strict grammar does not enforce (server/chat/structured.py)
        logger.warning("%s: %s", rid, cp.warning)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    rename = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else {}
    rename["grammar"] = "response_format" if cp.plan.choice in ("none", "auto") else "tool_choice"
    vllm = guided(req, req.response_format)  # checked when planning: this names the field for errors
    if vllm is not None:
        rename["grammar"] = vllm.param
    params = build_params(req, max_tokens, k, engine.tokenizer.vocab_size, state.sampling_defaults(), rename,
                          max_stop=state.cfg.max_stop_sequences, skip_special_tokens=False,
                          mark_special_tokens=True, grammar=cp.grammar,
                          prompt_logprobs=engine_prompt_logprobs(None, req.prompt_logprobs))

    def new_choice() -> ChatChoice:
        return ChatChoice(ChatOutputParser(cp.plan.parse, not req.skip_special_tokens, cp.max_calls,
                                           cp.plan.forced_names()))

    choices = {i: new_choice() for i in range(req.n)}
    images = {"images": cp.images} if cp.images else {}  # an engine client without images takes none
    gen = engine.generate(rid, cp.prompt_ids, params, anchors=cp.message_starts, **images)
    stream = OutputStream(engine, [(rid, gen)])
    ctx = _Ctx(state, req, rid, model, choices, TokenText(engine.tokenizer), k or 0, tracker, cp.echo)
    ctx.param_rename = rename
    ctx.prompt_ids = cp.prompt_ids
    return await ctx.respond(stream, request)


class _Ctx(RouteCtx):
    """Accumulates one chat request's outputs (both modes)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, rid: str, model: str,
                 choices: dict[int, ChatChoice], token_text: TokenText, top_logprobs: int,
                 tracker: RequestTracker, echo: str):
        super().__init__(state, req, rid, model, tracker)
        self.choices, self.token_text, self.top_logprobs = choices, token_text, top_logprobs
        self.echo = echo
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.legacy = legacy.legacy_functions(req)  # the old functions API: reply with function_call
        # vLLM's prompt_logprobs (server/prompt_logprobs.py), of the prompt's ids; streamed: on the next chunk
        self.prompt_ids: list[int] = []
        self.prompt_logprobs: list[Any] | None = None
        self.unsent_prompt_logprobs: list[Any] | None = None

    async def prepare(self, item: tuple[int, RequestOutput]) -> None:
        """Also format the prompt logprobs (choice 0's first output) on a worker thread."""
        await super().prepare(item)
        out = item[1]
        if out.prompt_logprobs is not None and out.index == 0 and self.req.prompt_logprobs is not None:
            fp = await run_cpu(format_prompt, self.prompt_ids, out.prompt_logprobs, self.token_text,
                               self.req.prompt_logprobs, None)
            self.prompt_logprobs = self.unsent_prompt_logprobs = fp.vllm

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        d = super().chunk(choices, usage)
        if choices and self.unsent_prompt_logprobs is not None:
            d["prompt_logprobs"], self.unsent_prompt_logprobs = self.unsent_prompt_logprobs, None
        return d

    def apply(self, out: RequestOutput) -> tuple[Any, list[dict[str, Any]]]:
        """Feed one engine output; returns this step's parsed delta and logprobs."""
        self.tracker.on_output(0, out)
        c = self.choices[out.index]
        self.prompt_tokens = out.prompt_tokens
        if out.index == 0 or self.cached_tokens is None:
            self.cached_tokens = out.cached_tokens
        delta = c.apply(out)
        lps = chat_logprobs(out.logprobs, self.token_text, self.top_logprobs) if out.logprobs else []
        c.logprobs.extend(lps)
        return delta, lps

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in self.choices.values())
        u = usage_dict(self.prompt_tokens, completion, self.cached_tokens or 0,
                       self.state.cfg.enable_cache_report)
        reasoning = sum(c.reasoning_tokens for c in self.choices.values())
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return u

    def log_finish(self) -> None:
        reasons = ",".join(str(c.reason()) for c in self.choices.values())
        self.tracker.finish(self.prompt_tokens, self.cached_tokens or 0,
                            sum(c.completion_tokens for c in self.choices.values()), reasons)

    def final_body(self) -> dict[str, Any]:
        out_choices = []
        for i, c in sorted(self.choices.items()):
            msg: dict[str, Any] = {"role": "assistant", "content": self.echo + c.content}
            if c.reasoning:
                msg["reasoning_content"] = msg["reasoning"] = c.reasoning
            if c.calls:
                if self.legacy:
                    msg["function_call"] = legacy.function_call(c.calls)
                else:
                    msg["tool_calls"] = c.tool_calls_openai()
                if not msg["content"]:
                    msg["content"] = None
            out_choices.append({"index": i, "message": msg,
                                "logprobs": {"content": c.logprobs} if self.req.logprobs else None,
                                "finish_reason": self.reason(c)})
        self.log_finish()
        body = {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out_choices, "usage": self.usage()}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        return body

    def collect(self, item: tuple[int, RequestOutput]) -> None:
        self.apply(item[1])

    def head_choices(self) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                 "finish_reason": None} for i in sorted(self.choices)]

    def stream_choice(self, item: tuple[int, RequestOutput]) -> dict[str, Any] | None:
        out = item[1]
        delta, lps = self.apply(out)
        c = self.choices[out.index]
        d: dict[str, Any] = {}
        if delta.reasoning:
            d["reasoning_content"] = d["reasoning"] = delta.reasoning
        if delta.content:
            d["content"] = delta.content
        if delta.tool_calls and self.legacy:
            fc = legacy.function_call_delta(delta.tool_calls)
            if fc is not None:
                d["function_call"] = fc
        elif delta.tool_calls:
            d["tool_calls"] = [tc.to_openai() for tc in delta.tool_calls]
        if not (d or out.token_ids or lps or out.finished):
            return None  # one event per token (docs/serving.md, "Streaming")
        if not d and not out.finished and c.parser.state == "content":
            d["content"] = ""  # a token that added no text: skipped, or bytes of a character held back
        return {"index": out.index, "delta": d, "logprobs": {"content": lps} if self.req.logprobs else None,
                "finish_reason": self.reason(c) if out.finished else None}

    def reason(self, c: ChatChoice) -> str | None:
        """The choice's finish_reason (function_call for the old functions API)."""
        return legacy.finish_reason(c.reason()) if self.legacy else c.reason()

    def chunk_usage(self) -> dict[str, Any] | None:
        opts = self.req.stream_options
        return self.usage() if opts is not None and opts.continuous_usage_stats else None
