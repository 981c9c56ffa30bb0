"""Chat planning in a worker process (server/off_loop.py run_proc): template rendering, tokenization and
the tool / structured-output grammar of every chat request, and for a large chat body (LARGE_BODY_BYTES)
also its parsing, validation and unknown-field walk. The server's process then never runs a client's
template and never holds a large body's messages: it gets back the prompt ids and the request with its
messages cut to the last one.

Each worker keeps the chat templates it has seen (compiled from their source, with a copy of the
tokenizer), keyed by a number the server gives each ChatTemplate object; a call names the key, and the
source and tokenizer travel only when a worker does not know the key yet (answer NEED_SETUP). The
render budget (engine/text/template_sandbox.py) is the server's, sent with each call. Errors keep their
order: the route raises a planning error only where it would have planned (server/chat/route.py)."""

from __future__ import annotations

import collections
import itertools
import pickle
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request

from swaserve.engine.core import GrammarSpec, ImageInput
from swaserve.engine.text.chat_template import ChatPrompt, ChatTemplate, build_chat_template
from swaserve.engine.text.grammar_check import llg_tokenizer
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.server.body import invalid_body, read_body, validate_json, validate_off_loop
from swaserve.server.chat import images as chat_images
from swaserve.server.chat import prompt as chat_prompt
from swaserve.server.chat.images import ImageParts, VisionSetup
from swaserve.server.chat.legacy_functions import legacy_functions
from swaserve.server.chat.structured import grammar_for, json_format
from swaserve.server.errors import APIError
from swaserve.server.guided import check_tool_choice, guided
from swaserve.server.leniency import scan_fields
from swaserve.server.off_loop import run_cpu, run_proc, start_processes, submit_each
from swaserve.server.prompt_limits import check_chars, check_tokens, message_chars
from swaserve.server.protocol import ChatCompletionRequest
from swaserve.server.sliced_validation import SLICED_BODY_BYTES, SlicedValidationError

if TYPE_CHECKING:
    from swaserve.server.state import ServerState

LARGE_BODY_BYTES = SLICED_BODY_BYTES  # from here on a chat body is parsed in the worker process
NEED_SETUP = "need-setup"
MAX_TEMPLATES = 4  # per worker


@dataclass
class ChatPlan:
    """Everything decided before generation."""

    prompt_ids: list[int]
    message_starts: list[int]
    plan: chat_prompt.ToolPlan
    grammar: GrammarSpec | None
    max_calls: int | None
    echo: str  # echo: the last message's content, prefixed to the reply (assistant messages only)
    warning: str | None = None  # schema keywords the grammar does not enforce (the route logs it)
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images, in order


def plan_with(template: ChatTemplate, req: ChatCompletionRequest,
              context_length: int | None = None, vision: VisionSetup | None = None) -> ChatPlan:
    """Messages, tools, template kwargs and structured output -> prompt and grammar (CPU work). A prompt
    longer than `context_length` is a 400: before rendering when its content alone is too long in
    characters (server/prompt_limits.py), else once tokenized. With `vision`, image parts are decoded and
    prepared here and their placeholders expanded (server/chat/images.py)."""
    plan = chat_prompt.tool_plan(req.tools, req.tool_choice, req.functions, req.function_call)
    found = ImageParts() if vision is not None else None
    messages = chat_prompt.message_dicts(req.messages, found)
    prepared = chat_images.prepare_all(found, vision) if found is not None and found.parts else []
    check_chars(message_chars(messages), context_length, template.tokenizer, "messages")
    kwargs, add_gen = chat_prompt.template_kwargs(req.chat_template_kwargs, req.add_generation_prompt,
                                                  req.reasoning_effort)
    if req.continue_final_message and req.add_generation_prompt is None:
        add_gen = False
    prompt = chat_prompt.render(template, messages, plan.tools, add_gen, kwargs, req.continue_final_message)
    ids, starts, images = list(prompt.token_ids), list(prompt.message_starts), []
    if prepared:
        assert vision is not None
        ids, starts, images = chat_images.expand(ids, starts, prepared, vision.spec)
    check_tokens(len(ids), context_length, "messages")
    rf = req.response_format
    fmt = json_format(rf.type if rf else None, rf.json_schema.schema_ if rf and rf.json_schema else None,
                      rf.json_schema.strict if rf and rf.json_schema else None, "response_format")
    vllm = guided(req, rf)  # vLLM's guided_* / structured_outputs (server/guided.py)
    check_tool_choice(vllm, plan.choice in ("required", "named"))
    if vllm is not None and vllm.fmt is not None:
        fmt = vllm.fmt
    parallel = False if legacy_functions(req) else req.parallel_tool_calls  # the old API: one call
    # the grammar is compiled once here (a worker process): one that crashes llguidance ends this worker
    so = grammar_for(plan, fmt, parallel, chat_prompt.thinking_enabled(kwargs), tokenizer=template.tokenizer)
    grammar = so.grammar
    if vllm is not None and vllm.spec is not None:
        grammar = vllm.spec  # a regex, choice or grammar: the whole reply
    echo = ""
    if req.echo and messages[-1]["role"] == "assistant":
        echo = messages[-1].get("content") or ""
    return ChatPlan(ids, starts, plan, grammar, so.max_calls, echo, so.warning, images)


# ---- in the worker process ----------------------------------------------------------------------------
_templates: collections.OrderedDict[int, ChatTemplate] = collections.OrderedDict()


def _worker_template(key: int, setup: bytes | None, limits: tuple[float, int]) -> ChatTemplate | None:
    """The template under `key`, rendering within the server's resolved limits (time s, max chars)."""
    t = _templates.get(key)
    if t is not None:
        _templates.move_to_end(key)
    elif setup is None:
        return None
    else:
        source, name, tokenizer = pickle.loads(setup)
        t = _templates[key] = build_chat_template(source, tokenizer, name=name)
        llg_tokenizer(tokenizer)  # grammars are compiled here first (grammar_for): ready before a request
        while len(_templates) > MAX_TEMPLATES:
            _templates.popitem(last=False)
    t.limits = RenderLimits(*limits)
    return t


def _plan_entry(key: int, setup: bytes | None, limits: tuple[float, int],
                arg: tuple[ChatCompletionRequest, int | None]) -> Any:
    template = _worker_template(key, setup, limits)
    return NEED_SETUP if template is None else plan_with(template, *arg)


def _render_entry(key: int, setup: bytes | None, limits: tuple[float, int], args: tuple) -> Any:
    template = _worker_template(key, setup, limits)
    return NEED_SETUP if template is None else chat_prompt.render(template, *args)


def _prepare_entry(key: int | None, setup: bytes | None, limits: tuple[float, int],
                   arg: tuple[bytes, int | None, VisionSetup | None]) -> Any:
    """A large body: ("invalid", errors) | ("ok", request with messages[-1:], fields, plan, plan error)."""
    raw, context_length, vision = arg
    template = None
    if key is not None:
        template = _worker_template(key, setup, limits)
        if template is None:
            return NEED_SETUP
    try:
        req = validate_json(ChatCompletionRequest, raw)
    except (ValidationError, SlicedValidationError) as e:
        return ("invalid", e.errors(include_url=False))
    fields = scan_fields(req)
    plan = error = None
    if template is not None:
        try:
            plan = plan_with(template, req, context_length, vision)
        except APIError as e:
            error = e
        except Exception:  # noqa: BLE001  (raised where the route plans: a 500 there, as before)
            error = RuntimeError(f"planning failed in a worker process:\n{traceback.format_exc()}")
    return ("ok", req.model_copy(update={"messages": req.messages[-1:]}), fields, plan, error)


# ---- in the server ------------------------------------------------------------------------------------
_keys = itertools.count(1)


def setup_of(template: ChatTemplate) -> tuple[int, bytes] | None:
    """(key, pickled source + name + tokenizer) of `template`, made once; None when it cannot go to a
    process (a test double): it is then rendered on a worker thread. 26b-a4b's: 51 MB, 0.4 s of
    pickling with the GIL held, so `swaserve serve` makes it while loading (start_workers)."""
    cached = getattr(template, "_worker_setup", None)
    if cached is None:
        try:
            blob = pickle.dumps((template.source, template.name, template.tokenizer))
        except Exception:  # noqa: BLE001  (anything unpicklable)
            blob = b""
        cached = (next(_keys), blob)
        template._worker_setup = cached  # type: ignore[attr-defined]
    return cached if cached[1] else None


async def _setup(template: ChatTemplate) -> tuple[int, bytes] | None:
    if hasattr(template, "_worker_setup"):
        return setup_of(template)
    return await run_cpu(setup_of, template)


def start_workers(template: ChatTemplate | None) -> None:
    """At server start (the loading thread, before /health turns 200): start the worker processes and
    give each the template, so that no request waits for either."""
    start_processes()
    setup = setup_of(template) if template is not None else None
    if setup is not None:
        submit_each(_worker_template, setup[0], setup[1], template.limits.resolved())


async def _call(entry: Any, template: ChatTemplate | None, arg: Any, heavy: bool | None = None) -> Any:
    # the server's limits, resolved here (a flag, else the module default as the server sees it)
    limit = (template.limits if template is not None else RenderLimits()).resolved()
    setup = await _setup(template) if template is not None else None
    key = setup[0] if setup else None
    if heavy is None:
        heavy = entry is _prepare_entry  # a large body: never in every worker at once
    out = await run_proc(entry, key, None, limit, arg, heavy=heavy)
    if out == NEED_SETUP:
        assert setup is not None
        out = await run_proc(entry, key, setup[1], limit, arg, heavy=heavy)
    return out


async def plan_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """plan_with the server's template, in a worker process."""
    template = state.chat_template()
    context_length = state.ready_engine().context_length
    vision = state.vision_setup()
    if await _setup(template) is None:
        return await run_cpu(plan_with, template, req, context_length, vision)
    return await _call(_plan_entry, template, (req, context_length, vision))


async def render(template: ChatTemplate, *args: Any) -> ChatPrompt:
    """chat_prompt.render(template, *args) in a worker process (/tokenize)."""
    if await _setup(template) is None:
        return await run_cpu(chat_prompt.render, template, *args)
    return await _call(_render_entry, template, args)


@dataclass
class ChatBody:
    """A chat request body; a large one comes back from the worker process already walked and planned,
    its messages cut to the last one (cut = True)."""

    req: ChatCompletionRequest
    cut: bool = False
    fields: tuple[list[str], list[str]] | None = None  # scan_fields, when done in the worker
    plan: ChatPlan | None = None
    plan_error: Exception | None = None  # APIError, or RuntimeError for an unexpected failure

    async def planned(self, state: ServerState) -> ChatPlan:
        """The plan (raising its error here, where the route plans), made now for an uncut body."""
        if not self.cut:
            return await plan_chat(state, self.req)
        if self.plan_error is not None:
            raise self.plan_error
        if self.plan is None:  # not ready when the body was read: same errors as planning now
            state.chat_template()
            raise APIError(503, "the model is still loading; retry shortly", None, "loading")
        return self.plan


async def chat_body(request: Request) -> ChatBody:
    """A FastAPI dependency: the ChatCompletionRequest body, a large one handled in a worker process."""
    raw = await read_body(request)
    if len(raw) < LARGE_BODY_BYTES:
        return ChatBody(await validate_off_loop(ChatCompletionRequest, raw))
    state: ServerState = request.app.state.swa
    try:
        template: ChatTemplate | None = state.chat_template()
    except APIError:  # loading, or no template: the route raises it in its place
        template = None
    if template is not None and await _setup(template) is None:
        return ChatBody(await validate_off_loop(ChatCompletionRequest, raw))
    context_length = state.engine.context_length if state.engine is not None else None
    out = await _call(_prepare_entry, template, (raw, context_length, state.vision_setup()))
    if out[0] == "invalid":
        raise invalid_body(out[1], raw)
    _, req, fields, plan, error = out
    return ChatBody(req, True, fields, plan, error)


chat_body.model = ChatCompletionRequest  # type: ignore[attr-defined]  # server/http/openapi_doc.py
