"""The synchronous engine core: requests in (`add_request`), one scheduler step at a time (`step`),
`RequestOutput`s out. Text is produced here (incremental detokenization, stop strings held back until
decided and cut from the output: engine/text/text_stream.py).

Single-threaded by contract: the offline API (`swaserve.llm.LLM`) calls it directly, the server
drives it through an engine front (engine/client/), whose engine loop (loop.py) owns the thread it runs on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from swaserve.engine.builder import build_engine_parts
from swaserve.engine.config import EngineConfig, VisionSpec
from swaserve.engine.core import (
    EngineClosed,
    ImageInput,
    Req,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from swaserve.engine.kvcache import Match, snapshot
from swaserve.engine.model_api import ModelBundle, generation_defaults
from swaserve.engine.runner.threads import governor_for
from swaserve.engine.scheduler import StepOutput, make_reqs
from swaserve.engine.text.grammar import GrammarBackend
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.text_stream import TextStream
from swaserve.engine.validation import RequestLimits, validate_request

log = logging.getLogger("swaserve.engine")


class Engine:
    """Owns the model runner, the KV pools, the prefix cache and the scheduler (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, bundle: ModelBundle):
        import torch

        if cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide intra-op pool
        t0 = time.monotonic()
        parts = build_engine_parts(cfg, bundle)
        self.threads = governor_for(cfg.cpu_threads_follow_load, cfg.cpu_threads, parts.device.type)
        self.config = cfg
        self.model_config = parts.model_config
        self.model_name = parts.model_name
        self.device = parts.device
        self.context_length = parts.context_length
        self.tokenizer = parts.tokenizer
        self.tokenizer_metadata = parts.tokenizer_metadata
        self.chat_template = parts.chat_template
        self.render_limits = RenderLimits.of(cfg)  # also for --chat-template (server/state.py)
        self.vision_spec: VisionSpec | None = parts.vision_spec
        # the loaded encoder's image soft tokens attend to each other on the sliding layers (Req.attn_blocks)
        self.bidirectional_images = self.vision_spec is not None and self.vision_spec.bidirectional_attention
        self.request_limits = RequestLimits(self.tokenizer.vocab_size, self.model_config.vocab_size,
                                            self.context_length, self.vision_spec is not None)
        self.eos_ids = parts.eos_ids
        self.pool = parts.pool
        self.full_alloc = parts.full_alloc
        self.swa_alloc = parts.swa_alloc
        self.arena = parts.arena
        self.cache = parts.cache
        self.tier = self.cache.tier  # the second KV tier (--kv-offload-dir; PrefixCache.tier)
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.grammar = GrammarBackend(self.tokenizer, self.eos_ids)  # compiles lazily, on first use
        self.runner.grammar = self.grammar
        self.generation_defaults = generation_defaults(bundle.metadata)
        self.debug_checks = cfg.debug_checks  # cache integrity after every step (tests, debugging)
        self.log_requests = True  # one INFO line per finished request; the server logs its own instead
        mc = self.model_config
        log.info("engine for %s ready in %.1fs (%d layers, window %d, context %d, device %s)",
                 self.model_name, time.monotonic() - t0, mc.num_layers, mc.sliding_window,
                 self.context_length, self.device)

        self._texts: dict[Req, TextStream] = {}  # choice -> its detokenizer, until it finishes
        self._open: dict[str, list[Req]] = {}  # request id -> its choices, until all finish
        self._seed_counter = itertools.count(1)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.sched_time = 0.0  # seconds in scheduling + cache bookkeeping (schedule + update)
        self.step_time = 0.0  # seconds in whole steps
        self.reuse_log = snapshot.ReuseLog()  # inspector: recent requests, reused length, why reuse stopped
        self.pool_history = snapshot.PoolHistory()  # inspector: pool usage, a sample a second while busy
        self.scheduler.kv.on_admit = self._record_reuse
        self.closed = False  # close(): the tier's thread joined, its file closed; no more requests

    # ---- requests in -----------------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                      anchors: Sequence[int] = (), images: Sequence[ImageInput] = ()) -> list[Req]:
        """Validate (engine/validation.py) and build the Reqs of one request (safe from any thread);
        RequestError on bad input, EngineClosed after close()."""
        self._check_open()
        validate_request(prompt_ids, params, self.request_limits, self.grammar.check, images)
        seed = (self.config.seed * 1_000_003 + next(self._seed_counter)) & 0x7FFF_FFFF_FFFF_FFFF
        reqs = make_reqs(request_id, [int(t) for t in prompt_ids], params, context_length=self.context_length,
                         eos_ids=self.eos_ids, seed=seed, anchors=anchors,
                         share_prompt=self.cache.reuses_prefixes, images=images,
                         vocab=self.model_config.vocab_size, bidirectional_images=self.bidirectional_images)
        now = time.monotonic()
        for r in reqs:
            r.arrival_time = now
        return reqs

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    anchors: Sequence[int] = (), images: Sequence[ImageInput] = ()) -> list[Req]:
        """Validate, build and queue one request; returns its choices."""
        reqs = self.make_requests(request_id, prompt_ids, params, anchors, images)
        self.add_reqs(reqs)
        return reqs

    def add_reqs(self, reqs: list[Req]) -> None:
        """Queue Reqs built by make_requests; RequestError when the request id is in use. All or nothing:
        when anything raises (a choice's text stream, the scheduler), no choice stays queued."""
        self._check_open()
        rid = reqs[0].request_id
        if rid in self._open:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        streams = [TextStream(self.tokenizer, r.params.stop, r.params.skip_special_tokens,
                              r.params.mark_special_tokens, r.params.include_stop_str_in_output)
                   for r in reqs]  # its stop strings and detokenizer: before anything is queued
        self._open[rid] = reqs
        try:
            for r, text_stream in zip(reqs, streams):
                self._texts[r] = text_stream
                self.scheduler.add(r)
        except BaseException:
            self.discard(rid)
            raise

    def discard(self, request_id: str) -> None:
        """Forget a request at once, with no output (its submission failed halfway): every choice
        already queued finishes with 'abort' and releases its pages."""
        for r in self._open.pop(request_id, []):
            self._texts.pop(r, None)
            r.grammar = None
            if r in self.scheduler.waiting or r in self.scheduler.running:
                try:
                    self.scheduler.finish(r, "abort")
                except Exception:  # noqa: BLE001 - keep forgetting the others
                    log.exception("releasing %s failed", r.rid)

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request; its pages are released on the next step."""
        if request_id in self._open:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._open) or self.scheduler.has_work()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, run the model, sample, update; returns the new outputs."""
        self._check_open()
        t0 = time.perf_counter()
        if self.threads is not None:  # the team follows the free cores (a busy neighbour stalls a wider one)
            self.threads.update()
        batch, aborted = self.scheduler.schedule()
        outs: list[RequestOutput] = []
        for r in aborted:
            try:
                outs.extend(self._finish_output(r, [], []))
            except Exception as e:  # noqa: BLE001 - flushing this request's held-back text: it fails alone
                outs.extend(self._fail_request(r, e))
        if batch is None:
            return outs
        t1 = time.perf_counter()
        tokens, logprobs = self.runner.execute(batch)
        t2 = time.perf_counter()
        # what a step and a prompt token cost: cache-aware admission's wait bound (scheduler/admission.py)
        self.scheduler.admission.costs.record(batch.prefill_tokens, t2 - t1)
        for req, exc in self.runner.failed.items():  # fails that request alone, before update sees it
            outs.extend(self._fail_request(req, exc))
        for req, lps in self.runner.prompt_logprobs.items():  # this step's prompt rows, in position order
            req.prompt_logprobs.extend(lps)
        step_outs = self.scheduler.update(batch, tokens, logprobs)
        t3 = time.perf_counter()
        outs.extend(self._process(step_outs))
        if self.debug_checks:
            self.scheduler.check_integrity()
        self.steps += 1
        self.sched_time += (t1 - t0) + (t3 - t2)
        self.step_time += time.perf_counter() - t0
        now = time.monotonic()
        if self.pool_history.due(now):
            self.pool_history.add(now, time.time(), self._pools())
        return outs

    def fail_all(self) -> list[str]:
        """Finish every request in flight with 'abort' and release its pages (after a failed step);
        returns their request ids."""
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for r in reqs:
            try:
                self.scheduler.finish(r, "abort")
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("releasing %s failed", r.rid)
            self._texts.pop(r, None)
            r.grammar = None
        ids = list({r.request_id: None for r in reqs})
        for rid in ids:
            self._open.pop(rid, None)
        return ids

    def _fail_request(self, req: Req, exc: BaseException) -> list[RequestOutput]:
        """Finish one choice as failed (its own data was at fault); every choice of its request ends."""
        log.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
        outs: list[RequestOutput] = []
        for c in self._open.get(req.request_id, [req]):
            if not c.finished:
                self.scheduler.finish(c, "abort")
            for out in self._finish_output(c, [], [], flush=False):
                out.error = f"{type(exc).__name__}: {exc}"
                outs.append(out)
        return outs

    def _process(self, step_outs: list[StepOutput]) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for so in step_outs:
            if so.token_id is None:
                if so.finished:  # max_tokens 0: the prompt is in, no token
                    if so.req.index == 0:
                        self.prompt_tokens_total += so.req.prompt_len
                    outs.extend(self._finish_output(so.req, [], []))
                continue
            try:
                outs.extend(self._process_one(so))
            except Exception as e:  # noqa: BLE001 - detokenizing / matching this request's text
                outs.extend(self._fail_request(so.req, e))
        return outs

    def _process_one(self, so: StepOutput) -> list[RequestOutput]:
        """One new token of one choice -> its output (text with stop strings held back or cut)."""
        now = time.monotonic()
        req = so.req
        self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        text_stream = self._texts[req]
        lps = [so.logprob] if so.logprob is not None else []
        if req.index == 0 and req.output_len == 1:
            self.prompt_tokens_total += req.prompt_len
        if so.finished:
            text, flush = "", True
            if not (req.finish_reason == "stop" and req.matched_stop == so.token_id):  # stop ids: no text
                text, matched = text_stream.push(so.token_id)
                if matched is not None:
                    req.finish_reason, req.matched_stop, flush = "stop", matched, False
            return self._finish_output(req, [so.token_id], lps, text, flush=flush)
        text, matched = text_stream.push(so.token_id)
        if matched is not None:
            self.scheduler.finish(req, "stop", matched)
            return self._finish_output(req, [so.token_id], lps, text, flush=False)
        return [RequestOutput(req.request_id, req.index, text, [so.token_id], lps or None, False,
                              None, req.prompt_len, req.cached_tokens or 0, req.output_len,
                              prompt_logprobs=req.take_prompt_logprobs())]

    def _finish_output(self, req: Req, new_ids: list[int], lps: list[TokenLogprob], text: str = "",
                       flush: bool = True) -> list[RequestOutput]:
        req.grammar = None  # the matcher is freed with the request (finished, stopped or aborted)
        text_stream = self._texts.get(req)
        if text_stream is None:
            return []
        if flush:  # when this raises the stream stays: _fail_request ends the choice with its error
            more, matched = text_stream.finish()
            text += more
            if matched is not None:
                req.finish_reason, req.matched_stop = "stop", matched
        del self._texts[req]
        req.finish_time = time.monotonic()
        out = RequestOutput(req.request_id, req.index, text, new_ids, lps or None, True, req.finish_reason,
                            req.prompt_len, req.cached_tokens or 0, req.output_len, req.matched_stop,
                            prompt_logprobs=req.take_prompt_logprobs())
        choices = self._open.get(req.request_id)
        if choices is not None and all(c.finished for c in choices):
            del self._open[req.request_id]
            self._log_finished(choices)
        return [out]

    def _log_finished(self, choices: list[Req]) -> None:
        r0 = choices[0]
        end = max(c.finish_time or 0.0 for c in choices)
        ttft = (r0.first_token_time - r0.arrival_time) if r0.first_token_time is not None else float("nan")
        emit = log.info if self.log_requests else log.debug
        emit("request %s: prompt %d tokens, cached %d, completion %d, ttft %.3fs, total %.3fs, finish %s",
             r0.request_id, r0.prompt_len, r0.cached_tokens or 0, sum(c.output_len for c in choices), ttft,
             end - r0.arrival_time, ",".join(str(c.finish_reason) for c in choices))

    # ---- introspection -------------------------------------------------------------------------------
    def _record_reuse(self, req: Req, m: Match) -> None:
        """KVManager.on_admit: on a request's first admission, log why its reuse stopped where it did."""
        if req.cached_tokens is None and req.index == 0:
            matched, reason = snapshot.explain_reuse(self.cache, req.token_ids, m.reused_len)
            if req.reuse_limit is not None and matched - m.reused_len >= self.cache.page_size:
                reason = "prompt_logprobs"  # not reused: its prompt logprobs need every row
            self.reuse_log.record(req.request_id, req.prompt_len, m.reused_len, matched, reason)

    def _pools(self) -> dict[str, dict[str, Any]]:
        """Per page kind the pages its arena blocks hold now (total = free + used by requests + cached),
        what can be allocated now and the most the arena could hold of it."""
        sched = self.scheduler
        used_full, used_swa = sched.kv.used_pages(sched.running)
        pools = {}
        for name, alloc, used in (("full_pool", self.full_alloc, used_full),
                                  ("swa_pool", self.swa_alloc, used_swa)):
            cap = alloc.num_total
            pools[name] = {"total": alloc.num_carved, "free": alloc.num_carved_free, "used": used,
                           "cached": alloc.num_used - used, "allocatable": alloc.num_free, "capacity": cap,
                           "usage": used / cap if cap else 0.0}
        return pools

    def _kv_storage(self) -> dict[str, Any]:
        """The KV cache's storage type (--kv-cache-dtype) and bytes per token of each pool kind (K and V of
        every layer of the kind, without arena padding)."""
        full, swa = self.pool.bytes_per_token()
        return {"kv_cache_dtype": self.pool.kv_format.name, "kv_bytes_per_token": {"full": full, "swa": swa}}

    def cache_state_walk(self, top_n: int = 64) -> snapshot.StateWalk:
        """The inspector's view (GET /v1/cache/state) as a resumable walk (engine/kvcache/snapshot.py): the
        asynchronous fronts advance it between steps, a quarter of a millisecond at a time."""
        state = yield from snapshot.walk_state(self.cache, top_n)
        now = time.monotonic()
        pools = self._pools()
        self.pool_history.add(now, time.time(), pools)
        state.update(cache_type=self.config.cache.cache_type, running=len(self.scheduler.running),
                     waiting=len(self.scheduler.waiting), pools=pools, arena=self.arena.stats(),
                     recent_requests=self.reuse_log.recent(), pool_history=self.pool_history.recent(),
                     **self._kv_storage())
        return state

    def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """cache_state_walk run to the end at once (offline use and tests)."""
        return snapshot.run_slice(self.cache_state_walk(top_n), None)[1]  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        """Queue lengths and their cap, the page size; both page kinds (see _pools); the arena's blocks; the
        KV storage type and bytes per token; prefix-cache counters, token totals and the seconds spent in
        steps."""
        sched = self.scheduler
        pools = self._pools()
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "max_running_requests": self.config.scheduler.max_running_requests,
            "page_size": self.config.cache.page_size,  # tokens per page of both pools
            **pools,
            "arena": self.arena.stats(),
            **self._kv_storage(),
            "prefix_cache_query_tokens": sched.prefix_query_tokens,
            "prefix_cache_hit_tokens": sched.prefix_hit_tokens,
            "prefix_cache_hit_tokens_by_tier": {
                "memory": sched.prefix_hit_tokens - sched.prefix_tier_hit_tokens,
                "offload": sched.prefix_tier_hit_tokens},
            "kv_tier": self.tier.stats() if self.tier is not None else None,
            "num_preemptions": sched.num_preemptions,
            "admission": sched.admission.stats(),  # policy, requests that waited, the measured step costs
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "busy_seconds_total": self.step_time,
            **(self.runner.images.stats() if self.runner.images is not None else {}),
        }

    # ---- shutdown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what outlives a step: requests still in flight finish with 'abort', the second tier's
        queued writes are sealed, its background thread joined, its file closed and its host level freed
        (a restart finds every record written). Idempotent; afterwards add_request raises EngineClosed."""
        if self.closed:
            return
        self.closed = True
        try:
            self.fail_all()
        finally:
            if self.tier is not None:
                self.tier.close()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosed("the engine is closed (Engine.close() was called); build a new one")

    def flush_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while requests run or wait."""
        if self.scheduler.running or self.scheduler.waiting or self._open:
            return False
        self.cache.reset()
        if self.tier is not None:
            self.tier.clear()
        return True
