"""POST /v1/completions: a string or token-id prompt, or a list of them (streamed and not)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from swaserve.engine.core import RequestOutput
from swaserve.server.body import json_body
from swaserve.server.errors import bad_request
from swaserve.server.guided import completion_grammar
from swaserve.server.leniency import check_fields
from swaserve.server.logprobs import TokenText, completion_logprobs
from swaserve.server.off_loop import run_cpu
from swaserve.server.params import build_params
from swaserve.server.prompt_logprobs import FormattedPrompt, engine_prompt_logprobs, format_prompt
from swaserve.server.prompt_tokens import LONG_PROMPT_CHARS, encode_prompt
from swaserve.server.protocol import CompletionRequest
from swaserve.server.route_ctx import RouteCtx
from swaserve.server.state import ServerState
from swaserve.server.streaming import OutputStream
from swaserve.server.tracking import RequestTracker, tracked
from swaserve.server.usage import usage_dict

router = APIRouter()


def _items(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def _prompts(req: CompletionRequest, tokenizer: Any,
             encoded: dict[int, list[int]]) -> list[tuple[list[int], str]]:
    """[(token ids, prompt text for echo)]; `encoded`: the ids of the long texts, by item."""
    items = _items(req)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            ids = encoded.get(i)
            if ids is None:
                ids = tokenizer.encode(item, add_bos=_add_bos(tokenizer, item))
            out.append((ids, item))
        else:
            if not item:
                raise bad_request(f"prompt[{i}] has no tokens", "prompt")
            bad = [t for t in item if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary (size "
                                  f"{tokenizer.vocab_size})", "prompt")
            out.append((list(item), tokenizer.decode(item, skip_special_tokens=False)))
    return out


def _add_bos(tokenizer: Any, text: str) -> bool:
    return not text.startswith(tokenizer.id_to_piece(tokenizer.bos_id))


async def _encode_texts(state: ServerState, req: CompletionRequest, tokenizer: Any,
                        context_length: int) -> dict[int, list[int]]:
    """The ids of the long prompt texts (longer than LONG_PROMPT_CHARS or the context in characters:
    bounded in memory, a 400 when they cannot fit, server/prompt_tokens.py), by item; the short ones are
    encoded with the rest."""
    items = [req.prompt] if isinstance(req.prompt, str) else await run_cpu(_items, req)  # O(ids): a thread
    out = {}
    for i, item in enumerate(items):
        if isinstance(item, str) and (len(item) >= LONG_PROMPT_CHARS or len(item) > context_length):
            out[i] = await encode_prompt(state, tokenizer, item, _add_bos(tokenizer, item), context_length)
    return out


@dataclass
class _Choice:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0
    logprobs: dict[str, list[Any]] | None = None
    prompt_logprobs: list[Any] | None = None  # vLLM's, when the request asked for them


@router.post("/v1/completions")
async def completions(body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
                      request: Request) -> Response:
    state: ServerState = request.app.state.swa
    rid = f"cmpl-{uuid.uuid4().hex}"
    return await tracked(state, rid, lambda tracker: _complete(state, body, request, rid, tracker))


async def _complete(state: ServerState, req: CompletionRequest, request: Request, rid: str,
                    tracker: RequestTracker) -> Response:
    await run_cpu(check_fields, req, state.cfg.strict_requests, rid)  # walks every message
    engine = state.ready_engine()
    model = state.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt and, with logprobs, "
                          "its logprobs)", "max_tokens")
    encoded = await _encode_texts(state, req, engine.tokenizer, engine.context_length)
    prompts = await run_cpu(_prompts, req, engine.tokenizer, encoded)  # tokenizing: off the event loop
    grammar, grammar_param = completion_grammar(req)  # vLLM's guided_* / structured_outputs
    rename = {"top_logprobs": "logprobs", "grammar": grammar_param or "grammar"}
    plp = engine_prompt_logprobs(req.logprobs if req.echo else None, req.prompt_logprobs)
    params = build_params(req, req.max_tokens, req.logprobs, engine.tokenizer.vocab_size,
                          state.sampling_defaults(), rename, max_stop=state.cfg.max_stop_sequences,
                          skip_special_tokens=req.skip_special_tokens, grammar=grammar,
                          prompt_logprobs=plp, min_max_tokens=0 if req.echo else 1)
    gens = []
    for i, (ids, _) in enumerate(prompts):
        sub = rid if len(prompts) == 1 else f"{rid}-{i}"
        gens.append((sub, engine.generate(sub, ids, params)))
    stream = OutputStream(engine, gens)
    ctx = _Ctx(state, req, rid, model, prompts, TokenText(engine.tokenizer), tracker)
    ctx.param_rename = rename
    return await ctx.respond(stream, request)


class _Ctx(RouteCtx):
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, req: CompletionRequest, rid: str, model: str,
                 prompts: list[tuple[list[int], str]], token_text: TokenText, tracker: RequestTracker):
        super().__init__(state, req, rid, model, tracker)
        self.prompts, self.token_text = prompts, token_text
        self.formatted: dict[int, FormattedPrompt] = {}  # choice index -> its prompt logprobs, formatted
        self.choices: dict[int, _Choice] = {}
        for p, (ids, text) in enumerate(prompts):
            for j in range(req.n):
                c = _Choice(prompt_tokens=len(ids))
                if req.echo:
                    c.offset = len(text)
                self.choices[p * req.n + j] = c

    async def prepare(self, item: tuple[int, RequestOutput]) -> None:
        """Also format a choice's prompt logprobs (its first output's) on a worker thread."""
        await super().prepare(item)
        p, out = item
        if out.prompt_logprobs is not None:
            ids, text = self.prompts[p]
            tok = self.token_text.tok
            bos_added = ids[0] == tok.bos_id and not text.startswith(tok.id_to_piece(tok.bos_id))
            echo_k = self.req.logprobs if self.req.echo else None
            self.formatted[p * self.req.n + out.index] = await run_cpu(
                format_prompt, ids, out.prompt_logprobs, self.token_text, self.req.prompt_logprobs, echo_k,
                bos_added)

    def apply(self, p: int, out: RequestOutput) -> tuple[int, str, dict[str, Any] | None, list[Any] | None]:
        """Feed one output of prompt p; returns (choice index, text delta, logprobs delta, vLLM's prompt
        logprobs when they came with this output)."""
        self.tracker.on_output(p, out)
        idx = p * self.req.n + out.index
        c = self.choices[idx]
        echo = ""
        if self.req.echo and not c.text and not c.completion_tokens:
            echo = self.prompts[p][1]
        c.text += out.text
        c.prompt_tokens = out.prompt_tokens
        c.cached_tokens = out.cached_tokens
        c.completion_tokens = out.completion_tokens
        fp = self.formatted.pop(idx, None)
        parts = [fp.echo] if fp is not None and fp.echo is not None else []  # echo: the prompt's first
        if self.req.logprobs is not None and out.logprobs:
            part = completion_logprobs(out.logprobs, self.token_text, self.req.logprobs, c.offset)
            c.offset = part["text_offset"][-1] + len(part["tokens"][-1]) if part["tokens"] else c.offset
            parts.append(part)
        lps = None
        if self.req.logprobs is not None and parts:
            lps = {key: [v for part in parts for v in part[key]] for key in parts[0]}
            if c.logprobs is None:
                c.logprobs = {k: [] for k in lps}
            for key, v in lps.items():
                c.logprobs[key].extend(v)
        if fp is not None and fp.vllm is not None:
            c.prompt_logprobs = fp.vllm
        if out.finished:
            c.finish_reason = out.finish_reason
        return idx, echo + out.text, lps, fp.vllm if fp is not None else None

    def _totals(self) -> tuple[int, int, int]:
        prompt = sum(self.choices[p * self.req.n].prompt_tokens for p in range(len(self.prompts)))
        cached = sum(self.choices[p * self.req.n].cached_tokens for p in range(len(self.prompts)))
        completion = sum(c.completion_tokens for c in self.choices.values())
        return prompt, cached, completion

    def usage(self) -> dict[str, Any]:
        prompt, cached, completion = self._totals()
        return usage_dict(prompt, completion, cached, self.state.cfg.enable_cache_report)

    def log_finish(self) -> None:
        prompt, cached, completion = self._totals()
        reasons = ",".join(sorted({str(c.finish_reason) for c in self.choices.values()}))
        self.tracker.finish(prompt, cached, completion, reasons)

    def final_body(self) -> dict[str, Any]:
        out = []
        for i, c in sorted(self.choices.items()):
            text = (self.prompts[i // self.req.n][1] if self.req.echo else "") + c.text
            lps = None
            if self.req.logprobs is not None:
                empty: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []}
                lps = c.logprobs or empty
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = c.prompt_logprobs
            out.append(choice)
        self.log_finish()
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": out, "usage": self.usage()}

    def collect(self, item: tuple[int, RequestOutput]) -> None:
        self.apply(*item)

    def stream_choice(self, item: tuple[int, RequestOutput]) -> dict[str, Any] | None:
        p, out = item
        idx, text, lps, prompt_lps = self.apply(p, out)
        if not (text or out.token_ids or lps or out.finished or prompt_lps):
            return None  # one event per token, "" when it added no text (docs/serving.md, "Streaming")
        choice = {"index": idx, "text": text, "logprobs": lps,
                  "finish_reason": out.finish_reason if out.finished else None}
        if prompt_lps is not None:  # with the choice's first output (vLLM refuses them streamed)
            choice["prompt_logprobs"] = prompt_lps
        return choice
