"""POST /v1/chat/completions (streamed and not)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from swaserve.engine.core import RequestOutput
from swaserve.server.common import (
    RequestTracker,
    RouteCtx,
    TokenText,
    build_params,
    chat_logprobs,
    tracked,
    usage_dict,
)
from swaserve.server.errors import bad_request
from swaserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from swaserve.server.reasoning import ChatOutputParser, ParsedDelta
from swaserve.server.state import ServerState
from swaserve.server.streaming import OutputStream
from swaserve.server.tool_parser import CALL_OPEN

router = APIRouter()


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    content: Any = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"content part type {part.type!r} is not supported (text only)",
                                  f"messages[{i}].content[{j}].type")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None and m.role != "assistant":
        content = ""
    d: dict[str, Any] = {"role": m.role, "content": content, "tool_calls": None}
    if m.tool_calls:
        calls = []
        for tc in m.tool_calls:
            args: Any = tc.function.arguments
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                    if isinstance(parsed, dict):
                        args = parsed
                except json.JSONDecodeError:
                    pass
            fn = {"name": tc.function.name, "arguments": args}
            calls.append({"id": tc.id, "type": "function", "function": fn})
        d["tool_calls"] = calls
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        v = getattr(m, key)
        if v is not None:
            d[key] = v
    return d


def _tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, bool, str | None]:
    """(tools for the template, whether to parse tool calls, forced tool name)."""
    tc = req.tool_choice
    if req.tools is not None and len(req.tools) == 0:
        raise bad_request("tools must not be empty (omit the field instead)", "tools")
    if not req.tools:
        if isinstance(tc, NamedToolChoice) or tc == "required":
            raise bad_request("tool_choice requires tools", "tool_choice")
        return None, False, None
    tools = []
    for t in req.tools:
        fn: dict[str, Any] = {"name": t.function.name, "description": t.function.description or ""}
        if t.function.parameters is not None:
            fn["parameters"] = t.function.parameters
        tools.append({"type": "function", "function": fn})
    if tc == "required":
        raise bad_request('tool_choice "required" is not supported (no constrained decoding); use "auto" '
                          "or name a function", "tool_choice")
    if isinstance(tc, NamedToolChoice):
        names = {t.function.name for t in req.tools}
        if tc.function.name not in names:
            raise bad_request(f"tool_choice names function {tc.function.name!r}, which is not in tools",
                              "tool_choice")
        return tools, True, tc.function.name
    return tools, tc != "none", None


@dataclass
class _Choice:
    parser: ChatOutputParser
    parsed: ParsedDelta = field(default_factory=ParsedDelta)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    tool_index: int = 0

    def reason(self, raw: str | None) -> str | None:
        if raw == "stop" and (self.parsed.tool_calls or self.tool_index):
            return "tool_calls"
        return raw


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.swa
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await tracked(state, rid, lambda tracker: _chat(state, body, request, rid, tracker))


async def _chat(state: ServerState, req: ChatCompletionRequest, request: Request, rid: str,
                tracker: RequestTracker) -> Response:
    engine = state.ready_engine()
    model = state.check_model(req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format {req.response_format.type!r} is not supported (no constrained "
                          "decoding)", "response_format")
    tools, parse_tools, forced = _tools(req)
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    kwargs = dict(req.chat_template_kwargs or {})
    add_gen = bool(kwargs.pop("add_generation_prompt", True))
    try:
        prompt = engine.chat_template.render(messages, tools=tools, add_generation_prompt=add_gen, **kwargs)
    except ValueError as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    prompt_ids = list(prompt.token_ids)
    forced_prefix = None
    if forced is not None:  # open the call in the prompt; the model writes the arguments
        forced_prefix = f"call:{forced}{{"
        prompt_ids += engine.tokenizer.encode(CALL_OPEN + forced_prefix)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    rename = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else None
    params = build_params(req, max_tokens, k, False, engine.tokenizer.vocab_size, rename)
    special = state.special

    def new_parser() -> ChatOutputParser:
        return ChatOutputParser(special, parse_tools, forced_prefix)

    choices = {i: _Choice(new_parser()) for i in range(req.n)}
    token_text = TokenText(engine.tokenizer)
    gen = engine.generate(rid, prompt_ids, params, anchors=list(prompt.message_starts))
    stream = OutputStream(engine, [(rid, gen)])
    ctx = _Ctx(state, req, rid, model, choices, token_text, k or 0, tracker)
    return await ctx.respond(stream, request)


class _Ctx(RouteCtx):
    """Accumulates one chat request's outputs (both modes)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, rid: str, model: str,
                 choices: dict[int, _Choice], token_text: TokenText, top_logprobs: int,
                 tracker: RequestTracker):
        super().__init__(state, req, rid, model, tracker)
        self.choices, self.token_text, self.top_logprobs = choices, token_text, top_logprobs
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None

    def apply(self, out: RequestOutput) -> tuple[ParsedDelta, list[dict[str, Any]]]:
        """Feed one engine output; returns this step's parsed delta and logprobs."""
        self.tracker.on_output(0, out)
        c = self.choices[out.index]
        self.prompt_tokens = out.prompt_tokens
        if out.index == 0 or self.cached_tokens is None:
            self.cached_tokens = out.cached_tokens
        delta = c.parser.feed(out.text)
        if out.finished:
            delta.extend(c.parser.finish())
            c.finish_reason = out.finish_reason
        if self.req.parallel_tool_calls is False:
            room = max(0, 1 - len(c.parsed.tool_calls))
            delta.tool_calls = delta.tool_calls[:room]
        c.parsed.extend(delta)
        c.completion_tokens = out.completion_tokens
        lps = chat_logprobs(out.logprobs, self.token_text, self.top_logprobs) if out.logprobs else []
        c.logprobs.extend(lps)
        return delta, lps

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in self.choices.values())
        return usage_dict(self.prompt_tokens, completion, self.cached_tokens or 0,
                          self.state.cfg.enable_cache_report)

    def log_finish(self) -> None:
        reasons = ",".join(str(c.reason(c.finish_reason)) for c in self.choices.values())
        self.tracker.finish(self.prompt_tokens, self.cached_tokens or 0,
                            sum(c.completion_tokens for c in self.choices.values()), reasons)

    def final_body(self) -> dict[str, Any]:
        out_choices = []
        for i, c in sorted(self.choices.items()):
            msg: dict[str, Any] = {"role": "assistant", "content": c.parsed.content}
            if c.parsed.reasoning:
                msg["reasoning_content"] = c.parsed.reasoning
            if c.parsed.tool_calls:
                msg["tool_calls"] = [tc.to_openai() for tc in c.parsed.tool_calls]
                if not c.parsed.content:
                    msg["content"] = None
            out_choices.append({"index": i, "message": msg,
                                "logprobs": {"content": c.logprobs} if self.req.logprobs else None,
                                "finish_reason": c.reason(c.finish_reason)})
        self.log_finish()
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out_choices, "usage": self.usage()}

    def collect(self, item: tuple[int, RequestOutput]) -> None:
        self.apply(item[1])

    def head_choices(self) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in sorted(self.choices)]

    def stream_choice(self, item: tuple[int, RequestOutput]) -> dict[str, Any] | None:
        out = item[1]
        delta, lps = self.apply(out)
        c = self.choices[out.index]
        d: dict[str, Any] = {}
        if delta.reasoning:
            d["reasoning_content"] = delta.reasoning
        if delta.content:
            d["content"] = delta.content
        if delta.tool_calls:
            d["tool_calls"] = []
            for tc in delta.tool_calls:
                d["tool_calls"].append(tc.to_openai(index=c.tool_index))
                c.tool_index += 1
        if not (d or lps or out.finished):
            return None
        return {"index": out.index, "delta": d, "logprobs": {"content": lps} if self.req.logprobs else None,
                "finish_reason": c.reason(c.finish_reason) if out.finished else None}
