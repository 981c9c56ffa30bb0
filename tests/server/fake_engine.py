"""A scripted stand-in for an engine front (engine/client/base.py: EngineClient), for failure injection in
server tests.

It uses the real demo tokenizer and chat template; generation replays `reply` (text, tokenized) or emits
deterministic tokens, and can raise mid-stream (`fail_after`) or refuse work (`overloaded`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from swaserve.engine.core import EngineOverloaded, RequestError, RequestOutput, SamplingParams, TokenLogprob
from swaserve.engine.text.chat_template import ChatTemplate
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata


class FakeEngine:
    model_name = "fake-model"

    def __init__(self, context_length: int = 4096, chat_template: bool = True):
        meta = demo_tokenizer_metadata()
        self.tokenizer = Tokenizer.from_metadata(meta)
        self.chat_template = (ChatTemplate(meta["tokenizer.chat_template"], self.tokenizer) if chat_template
                              else None)
        self.render_limits = RenderLimits()
        self.generation_defaults: dict[str, float] = {}
        self.log_requests = False
        self.context_length = context_length
        self.reply: str | None = None
        self.reply_ids: list[int] | None = None  # replayed as is (text spelled with any tokens)
        self.fail_after: int | None = None  # raise after this many outputs
        self.fail_error: BaseException | None = None  # what fail_after raises (default RuntimeError)
        self.down: BaseException | None = None  # what check_available() raises (an engine restarting)
        self.overloaded = False
        self.delay_s = 0.0
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.last_prompt: list[int] = []
        self.last_anchors: list[int] = []
        self.last_params: SamplingParams | None = None

    def start(self) -> None:
        pass

    def check_available(self) -> None:
        if self.down is not None:
            raise self.down

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        self.shutdown()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def flush_cache(self) -> bool:
        return not self.running

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        return {"nodes": []}  # no prefix cache

    def stats(self) -> dict[str, Any]:
        pool = {"total": 100, "free": 100 - len(self.running), "used": len(self.running), "cached": 0,
                "usage": len(self.running) / 100}
        return {"running": len(self.running), "waiting": 0, "full_pool": pool, "swa_pool": dict(pool),
                "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0, "prompt_tokens_total": 0,
                "generation_tokens_total": 0}

    def _tokens(self, prompt: list[int], params: SamplingParams) -> list[int]:
        if self.reply_ids is not None:
            return list(self.reply_ids)
        if self.reply is not None:
            return self.tokenizer.encode(self.reply)
        n = params.max_tokens or 8
        normal = [i for i in range(10, self.tokenizer.vocab_size) if i not in self.tokenizer.special_ids]
        return [normal[(sum(prompt) * 7 + 13 * k) % len(normal)] for k in range(n)]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        if not prompt_ids:
            raise RequestError("prompt is empty", "messages")
        if len(prompt_ids) >= self.context_length:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; the context is {self.context_length}",
                               "messages")
        if self.overloaded:
            raise EngineOverloaded("queue full")
        params.validate(self.tokenizer.vocab_size)
        self.last_prompt, self.last_anchors, self.last_params = list(prompt_ids), list(anchors), params
        self.running.add(request_id)
        sent = 0
        try:
            toks = self._tokens(prompt_ids, params)
            if params.max_tokens is not None:
                toks = toks[:params.max_tokens]
            for idx in range(params.n):
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                               params.mark_special_tokens)
                for k, t in enumerate(toks):
                    await asyncio.sleep(self.delay_s)
                    if self.fail_after is not None and sent >= self.fail_after:
                        raise self.fail_error or RuntimeError("injected failure")
                    last = k == len(toks) - 1
                    text = detok.push(t) + (detok.flush() if last else "")
                    lps = None
                    if params.logprobs is not None:
                        lps = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)][:params.logprobs])]
                    sent += 1
                    reason = ("length" if params.max_tokens == len(toks) else "stop") if last else None
                    yield RequestOutput(request_id, idx, text, [t], lps, last, reason, len(prompt_ids), 0,
                                        k + 1)
        finally:
            self.running.discard(request_id)
