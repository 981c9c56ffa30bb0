"""POST /v1/responses: the Responses API (the OpenAI Agents SDK's default) for text and function tools,
streamed and not, on the chat path (same prompt rendering, grammars and output parser).

Stream events, in order (each with a `sequence_number`): response.created, response.in_progress; per
output item (reasoning, message, function_call, in the order the model writes them):
response.output_item.added, then for reasoning and messages response.content_part.added, deltas
(response.reasoning_text.delta / response.output_text.delta), the matching .done, response.content_part.done;
for calls response.function_call_arguments.delta ... .done; then response.output_item.done; finally
response.completed (or response.incomplete with incomplete_details.reason max_output_tokens).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from swaserve.engine.core import RequestError
from swaserve.server.body import json_body
from swaserve.server.chat.choice import ChatChoice
from swaserve.server.chat.reasoning import ChatOutputParser, ParsedDelta
from swaserve.server.chat.worker import ChatPlan, plan_chat
from swaserve.server.errors import APIError, bad_request, from_exception
from swaserve.server.json_out import json_response
from swaserve.server.leniency import check_fields
from swaserve.server.off_loop import run_cpu
from swaserve.server.params import build_params
from swaserve.server.protocol import ChatCompletionRequest
from swaserve.server.responses.input import (
    ResponsesRequest,
    dumps,
    echo_tools,
    function_tools,
    input_messages,
    text_format,
)
from swaserve.server.responses.store import ResponseStore, StoredResponse, input_items, owner_of
from swaserve.server.state import ServerState
from swaserve.server.streaming import OutputStream, SSEResponse
from swaserve.server.tracking import RequestTracker, tracked

router = APIRouter()


def _chat_request(req: ResponsesRequest, history: list[dict[str, Any]] | None) -> ChatCompletionRequest:
    tools, choice = function_tools(req)
    kind, schema, strict = text_format(req)
    fmt = None
    if kind not in (None, "text"):
        fmt = {"type": kind}
        if kind == "json_schema":
            fmt["json_schema"] = {"name": "output", "schema": schema, "strict": strict}
    effort = (req.reasoning or {}).get("effort")
    try:
        return ChatCompletionRequest(messages=input_messages(req, history), tools=tools, tool_choice=choice,
                                     parallel_tool_calls=req.parallel_tool_calls, response_format=fmt,
                                     reasoning_effort=effort, chat_template_kwargs=req.chat_template_kwargs)
    except ValidationError as e:  # a field the checks above let through: a 400 naming it, never a 500
        err = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise bad_request(f"invalid value for {where}: {err.get('msg')}", where or None) from None


@router.post("/v1/responses")
async def responses(body: Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))],
                    request: Request) -> Response:
    state: ServerState = request.app.state.swa
    rid = f"resp_{uuid.uuid4().hex}"
    return await tracked(state, rid, lambda tracker: _respond(state, body, request, rid, tracker))


async def _respond(state: ServerState, req: ResponsesRequest, request: Request, rid: str,
                   tracker: RequestTracker) -> Response:
    await run_cpu(check_fields, req, state.cfg.strict_requests, rid)  # walks every message
    engine = state.ready_engine()
    model = state.check_model(req.model)
    if req.n != 1:
        raise bad_request("n must be 1 for /v1/responses", "n")
    store: ResponseStore = request.app.state.responses
    owner = owner_of(request, bool(state.cfg.api_key))
    prev = None
    if req.previous_response_id is not None:  # continue a stored conversation
        prev = store.get(owner, req.previous_response_id)
        if prev is None:
            why = "" if store.enabled else " (this server keeps no responses: --responses-store-size 0)"
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found{why}.",
                           "previous_response_id", "previous_response_not_found")
    chat_req = await run_cpu(_chat_request, req, prev.items if prev else None)  # every item: off the loop
    cp: ChatPlan = await plan_chat(state, chat_req)  # in a worker process
    if cp.warning:  # schema keywords a non-strict grammar does not enforce (server/chat/structured.py)
        logging.getLogger("swaserve.server").warning("%s: %s", rid, cp.warning)
    rename = {"max_tokens": "max_output_tokens", "top_logprobs": "top_logprobs",
              "grammar": "text.format" if cp.plan.choice in ("none", "auto") else "tool_choice"}
    params = build_params(req, req.max_output_tokens, None, engine.tokenizer.vocab_size,
                          state.sampling_defaults(), rename, max_stop=state.cfg.max_stop_sequences,
                          skip_special_tokens=False,
                          mark_special_tokens=True, grammar=cp.grammar)
    choice = ChatChoice(ChatOutputParser(cp.plan.parse, not req.skip_special_tokens, cp.max_calls,
                                         cp.plan.forced_names()))
    images = {"images": cp.images} if cp.images else {}  # an engine client without images takes none
    gen = engine.generate(rid, cp.prompt_ids, params, anchors=cp.message_starts, **images)
    stream = OutputStream(engine, [(rid, gen)])
    ctx = _Ctx(state, req, rid, model, choice, tracker, rename)
    ctx.keep = _Keeper(store, owner, prev, req) if store.enabled and req.store is not False else None
    poll = state.cfg.disconnect_poll_s
    if not req.stream:
        try:
            while (item := await ctx.next(stream, request, poll)) is not None:
                ctx.feed(item[1])
        finally:
            stream.close()
        ctx.log_finish()
        body = ctx.response(ctx.status())
        if ctx.keep is not None:
            await run_cpu(ctx.keep.put, body)
        return await json_response(body)  # a large body: off the loop
    try:
        first = await ctx.next(stream, request, poll)
    except BaseException:
        stream.close()
        raise
    return SSEResponse(ctx.events(stream, first))


class _Ctx:
    def __init__(self, state: ServerState, req: ResponsesRequest, rid: str, model: str, choice: ChatChoice,
                 tracker: RequestTracker, rename: dict[str, str]):
        self.state, self.req, self.rid, self.model, self.choice = state, req, rid, model, choice
        self.tracker, self.rename = tracker, rename
        self.created = int(time.time())
        self.prompt_tokens = self.cached_tokens = 0
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items in order, as streamed
        self.calls: dict[int, int] = {}  # tool call index -> output index
        self.open: int | None = None  # output index of the open reasoning / message item
        self.keep: _Keeper | None = None  # store: true (and a store): kept once finished

    async def next(self, stream: OutputStream, request: Request | None = None, poll: float = 0.25) -> Any:
        try:
            return await stream.next(request, poll)
        except RequestError as e:
            new = self.rename.get(e.param or "")
            if new is None:
                raise
            raise APIError(400, str(e).replace(str(e.param), new), new, "invalid_value") from None

    def feed(self, out: Any) -> ParsedDelta:
        self.tracker.on_output(0, out)
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        return self.choice.apply(out)

    def status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def log_finish(self) -> None:
        self.tracker.finish(self.prompt_tokens, self.cached_tokens, self.choice.completion_tokens,
                            str(self.choice.reason()))

    # ---- objects --------------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        c = self.choice
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": c.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                "total_tokens": self.prompt_tokens + c.completion_tokens}

    def final_items(self) -> list[dict[str, Any]]:
        c = self.choice
        items: list[dict[str, Any]] = []
        if c.reasoning:
            items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", c.reasoning, "completed"))
        if c.content:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", c.content, "completed"))
        for call in c.calls:
            items.append(_call_item(call, "completed"))
        return items

    def response(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        r = self.req
        done = status in ("completed", "incomplete")
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if done else None, "model": self.model,
            "output": (output if output is not None else self.final_items()) if done else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "store": self.keep is not None, "temperature": r.temperature, "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": echo_tools(r), "truncation": "disabled", "metadata": r.metadata or {}, "user": r.user,
            "usage": self.usage() if done else None,
        }

    # ---- stream ---------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    def _close_open(self) -> list[str]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        item = self.items[i]
        ev: list[str] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            ev.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=text))
            part = {"type": "reasoning_text", "text": text}
        else:
            text = item["content"][0]["text"]
            ev.append(self._event("response.output_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=text, logprobs=[]))
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        ev.append(self._event("response.content_part.done", item_id=item["id"], output_index=i,
                              content_index=0, part=part))
        item["status"] = "completed"
        ev.append(self._event("response.output_item.done", output_index=i, item=item))
        return ev

    def _text(self, kind: str, text: str) -> list[str]:
        ev: list[str] = []
        cur = self.items[self.open] if self.open is not None else None
        if cur is None or cur["type"] != kind:
            ev += self._close_open()
            i = len(self.items)
            if kind == "reasoning":
                item = _reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self.open = i
            added = {**item, "content": []}
            ev.append(self._event("response.output_item.added", output_index=i, item=added))
            ev.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
        i = self.open
        assert i is not None
        item = self.items[i]
        item["content"][0]["text"] += text
        if kind == "reasoning":
            ev.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=i,
                                  content_index=0, delta=text))
        else:
            ev.append(self._event("response.output_text.delta", item_id=item["id"], output_index=i,
                                  content_index=0, delta=text, logprobs=[]))
        return ev

    def _delta_events(self, delta: ParsedDelta) -> list[str]:
        ev: list[str] = []
        if delta.reasoning:
            ev += self._text("reasoning", delta.reasoning)
        if delta.content:
            ev += self._text("message", delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                ev += self._close_open()
                i = len(self.items)
                self.calls[d.index] = i
                item = _call_item({"id": d.id, "name": d.name, "arguments": ""}, "in_progress")
                self.items.append(item)
                ev.append(self._event("response.output_item.added", output_index=i, item=dict(item)))
            i = self.calls[d.index]
            if d.arguments:
                self.items[i]["arguments"] += d.arguments
                ev.append(self._event("response.function_call_arguments.delta", item_id=self.items[i]["id"],
                                      output_index=i, delta=d.arguments))
        return ev

    def _close_calls(self) -> list[str]:
        ev: list[str] = []
        for i in sorted(self.calls.values()):
            item = self.items[i]
            if item["status"] == "completed":
                continue
            item["status"] = "completed"
            ev.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
            ev.append(self._event("response.output_item.done", output_index=i, item=item))
        return ev

    async def events(self, stream: OutputStream, first: Any) -> AsyncIterator[str]:
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            item = first
            while item is not None:
                for ev in self._delta_events(self.feed(item[1])):
                    yield ev
                item = await self.next(stream)
            for ev in self._close_open() + self._close_calls():
                yield ev
            status = self.status()
            kind = "response.completed" if status == "completed" else "response.incomplete"
            self.log_finish()
            final = self.response(status, self.items)
            if self.keep is not None:
                await run_cpu(self.keep.put, final)
            yield self._event(kind, response=final)
        except Exception as e:
            self.tracker.fail(e)
            err = from_exception(e)
            yield self._event("error", code=err.code or err.type, message=err.message, param=err.param)
        finally:
            stream.close()
            self.tracker.disconnected()


class _Keeper:
    """Stores one finished response with its conversation (server/responses/store.py)."""

    def __init__(self, store: ResponseStore, owner: str, prev: StoredResponse | None, req: ResponsesRequest):
        self.store, self.owner, self.prev, self.req = store, owner, prev, req

    def put(self, response: dict[str, Any]) -> None:
        """A worker thread: the conversation's size is measured as JSON."""
        self.store.put(self.owner, response, self.prev, [*input_items(self.req.input), *response["output"]])


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["name"], "arguments": call["arguments"], "status": status}
