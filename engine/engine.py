"""Engine: owns the model, the KV pools, the prefix cache and the scheduler; runs steps in a loop thread.

Synchronous core (`add_request`, `step`) used by the loop thread and by the offline LLM API; an async
`generate` for the server bridges through thread-safe queues (submissions, aborts) and, per request,
an asyncio.Queue fed with loop.call_soon_threadsafe. Text (incremental detokenization, stop strings
held back until decided and cut from the output: engine/text_stream.py) is produced here, on the loop
thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from swaserve.engine.config import EngineConfig
from swaserve.engine.core import (
    EngineOverloaded,
    Req,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from swaserve.engine.model_api import ModelBundle
from swaserve.engine.scheduler import KVManager, Scheduler, StepOutput, make_reqs
from swaserve.engine.text_stream import TextStream
from swaserve.engine.tokenizer import ChatTemplate, Tokenizer

log = logging.getLogger("swaserve.engine")


class _Track:
    """Engine-side state of one choice."""

    __slots__ = ("text", "sent_tokens", "done")

    def __init__(self, text: TextStream):
        self.text = text
        self.sent_tokens = 0
        self.done = False


class Engine:
    """See the module docstring and notes/contracts.md (Engine)."""

    def __init__(self, cfg: EngineConfig, bundle: ModelBundle):
        # One INFO line per finished request; the server logs its own line and turns this off.
        self.log_requests = True
        from swaserve.engine.attention.kv_pool import KVPool
        from swaserve.engine.kvcache import PageAllocator, SWARadixCache
        from swaserve.engine.model_runner import ModelRunner, plan_kv_pools

        self.config = cfg
        self.device = bundle.device
        if cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide intra-op pool
        t0 = time.monotonic()
        mc = bundle.config
        self.model_config = mc
        self.model_name = bundle.name
        self.tokenizer = Tokenizer.from_metadata(bundle.metadata)
        tmpl = bundle.metadata.get("tokenizer.chat_template")
        self.chat_template = ChatTemplate(tmpl, self.tokenizer) if tmpl else None
        self.eos_ids = frozenset(self.tokenizer.eos_ids) | frozenset(mc.eos_token_ids)
        self.model = bundle.model
        path = bundle.path

        cc, sc = cfg.cache, cfg.scheduler
        context = sc.context_length or mc.context_length
        plan = plan_kv_pools(mc, cc, sc, context, self.device)  # after the weights: sized from what is left
        cap = plan.full_pages * cc.page_size
        if context > cap:
            log.warning("context length %d exceeds the full KV pool (%d tokens); serving up to %d", context,
                        cap, cap)
            context = cap
        self.context_length = context
        self.pool = KVPool(mc, plan.full_pages, plan.swa_pages, cc.page_size, plan.dtype, self.device)
        if self.device.type == "cpu":  # make the pools resident now: memory stays flat while serving
            for t in (self.pool.full_k, self.pool.full_v, self.pool.swa_k, self.pool.swa_v):
                t.fill_(0)
        log.info("KV pools: %s", plan.describe(cc.page_size, mc))
        self.full_alloc = PageAllocator(plan.full_pages)
        self.swa_alloc = PageAllocator(plan.swa_pages)
        enabled = cc.cache_type == "radix"
        self.cache = SWARadixCache(cc.page_size, mc.sliding_window, self.full_alloc, self.swa_alloc,
                                   retain_budget=cc.swa_retain_budget, policy=cc.swa_retain_policy,
                                   enabled=enabled)
        kv = KVManager(self.cache, self.full_alloc, self.swa_alloc, cc.page_size, mc.sliding_window, enabled)
        self.scheduler = Scheduler(sc, kv, context)
        self.runner = ModelRunner(self.model, self.pool, cc.page_size, mc.sliding_window, self.device)
        self.debug_checks = os.environ.get("SWASERVE_DEBUG", "") not in ("", "0")
        log.info("engine for %s ready in %.1fs (%s, %d layers, window %d, context %d, device %s)",
                 self.model_name, time.monotonic() - t0, Path(path).name, mc.num_layers, mc.sliding_window,
                 context, self.device)

        self._tracks: dict[Req, _Track] = {}
        self._open: dict[str, list[Req]] = {}  # request id -> its choices, until all finish
        self._seed_counter = itertools.count(1)
        self._submit_q: queue.SimpleQueue[list[Req]] = queue.SimpleQueue()
        self._abort_q: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.sched_time = 0.0  # seconds in scheduling + cache bookkeeping (schedule + update)
        self.step_time = 0.0  # seconds in whole steps
        self._stats: dict[str, Any] = {}
        self._refresh_stats()

    # ---- synchronous core ---------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                      anchors: Sequence[int] = ()) -> list[Req]:
        """Validate and build the Reqs of one request (any thread); RequestError on bad input."""
        params.validate(self.tokenizer.vocab_size)
        if any(not 0 <= int(t) < self.model_config.vocab_size for t in prompt_ids):
            raise RequestError("the prompt contains token ids outside the vocabulary", "prompt")
        seed = (self.config.seed * 1_000_003 + next(self._seed_counter)) & 0x7FFF_FFFF_FFFF_FFFF
        reqs = make_reqs(request_id, [int(t) for t in prompt_ids], params, context_length=self.context_length,
                         eos_ids=self.eos_ids, seed=seed, anchors=anchors,
                         share_prompt=self.config.cache.cache_type == "radix")
        now = time.monotonic()
        for r in reqs:
            r.arrival_time = now
        return reqs

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    anchors: Sequence[int] = ()) -> list[Req]:
        """Synchronous submission (offline use; not while the loop thread runs)."""
        reqs = self.make_requests(request_id, prompt_ids, params, anchors)
        self._add(reqs)
        return reqs

    def _add(self, reqs: list[Req]) -> None:
        rid = reqs[0].request_id
        if rid in self._open:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        self._open[rid] = reqs
        for r in reqs:
            self._tracks[r] = _Track(TextStream(self.tokenizer, r.params.stop, r.params.skip_special_tokens))
            self.scheduler.add(r)

    def has_unfinished(self) -> bool:
        return bool(self._open) or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, run the model, sample, update; returns the new outputs."""
        with self._step_lock:
            t0 = time.perf_counter()
            batch, aborted = self.scheduler.schedule()
            outs: list[RequestOutput] = []
            for r in aborted:
                outs.extend(self._finish_output(r, [], []))
            for o in outs:
                self._emit(o)
            if batch is None:
                if aborted:  # pages were released: the stats snapshot must show it
                    self._refresh_stats()
                return outs
            t1 = time.perf_counter()
            tokens, logprobs = self.runner.execute(batch)
            t2 = time.perf_counter()
            step_outs = self.scheduler.update(batch, tokens, logprobs)
            t3 = time.perf_counter()
            outs.extend(self._process(step_outs))
            if self.debug_checks:
                self.scheduler.check_integrity()
            self.steps += 1
            self.sched_time += (t1 - t0) + (t3 - t2)
            self.step_time += time.perf_counter() - t0
            self._refresh_stats()
            return outs

    def _process(self, step_outs: list[StepOutput]) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        now = time.monotonic()
        for so in step_outs:
            req = so.req
            if so.token_id is None:
                continue
            self.generation_tokens_total += 1
            if req.first_token_time is None:
                req.first_token_time = now
            tr = self._tracks[req]
            lps = [so.logprob] if so.logprob is not None else []
            if req.index == 0 and req.output_len == 1:
                self.prompt_tokens_total += req.prompt_len
            if so.finished:
                text, flush = "", True
                if not (req.finish_reason == "stop" and req.matched_stop == so.token_id):  # stop ids: no text
                    text, matched = tr.text.push(so.token_id)
                    if matched is not None:
                        req.finish_reason, req.matched_stop, flush = "stop", matched, False
                outs.extend(self._finish_output(req, [so.token_id], lps, text, flush=flush))
                continue
            text, matched = tr.text.push(so.token_id)
            if matched is not None:
                self.scheduler.finish(req, "stop", matched)
                outs.extend(self._finish_output(req, [so.token_id], lps, text, flush=False))
                continue
            tr.sent_tokens += 1
            outs.append(RequestOutput(req.request_id, req.index, text, [so.token_id], lps or None, False,
                                      None, req.prompt_len, req.cached_tokens or 0, req.output_len))
        for o in outs:
            self._emit(o)
        return outs

    def _finish_output(self, req: Req, new_ids: list[int], lps: list[TokenLogprob], text: str = "",
                       flush: bool = True) -> list[RequestOutput]:
        tr = self._tracks.pop(req, None)
        if tr is None:
            return []
        if flush:
            more, matched = tr.text.finish()
            text += more
            if matched is not None:
                req.finish_reason, req.matched_stop = "stop", matched
        req.finish_time = time.monotonic()
        out = RequestOutput(req.request_id, req.index, text, new_ids, lps or None, True, req.finish_reason,
                            req.prompt_len, req.cached_tokens or 0, req.output_len, req.matched_stop)
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
        emit("request %s: prompt %d tokens, cached %d, completion %d, ttft %.3fs, total %.3fs, "
                  "finish %s", r0.request_id, r0.prompt_len, r0.cached_tokens or 0,
                  sum(c.output_len for c in choices), ttft, end - r0.arrival_time,
                  ",".join(str(c.finish_reason) for c in choices))

    # ---- background loop and async API ----------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="swaserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None
        for rid in list(self._streams):  # streams still open will get no more outputs
            self._emit_error(rid, RuntimeError("the engine was shut down"))

    def _drain(self) -> None:
        while True:
            try:
                reqs = self._submit_q.get_nowait()
            except queue.Empty:
                break
            try:
                self._add(reqs)
            except RequestError as e:
                self._emit_error(reqs[0].request_id, e)
        while True:
            try:
                rid = self._abort_q.get_nowait()
            except queue.Empty:
                break
            if rid in self._open:
                self.scheduler.abort(rid)

    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if not self.scheduler.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a failed step fails the requests in flight, the engine lives on
                log.exception("engine step failed")
                self._fail_all(e)

    def _fail_all(self, exc: Exception) -> None:
        with self._step_lock:
            reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
            for r in reqs:
                try:
                    self.scheduler.finish(r, "abort")
                except Exception:  # noqa: BLE001 - keep failing the others
                    log.exception("releasing %s failed", r.rid)
                self._tracks.pop(r, None)
            for rid in {r.request_id for r in reqs}:
                self._open.pop(rid, None)
                self._emit_error(rid, RuntimeError(f"engine error: {exc}"))
            self._refresh_stats()

    def _emit(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        if s is None:
            return
        loop, q = s
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is gone
            self.abort(out.request_id)

    def _emit_error(self, request_id: str, exc: BaseException) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            try:
                s[0].call_soon_threadsafe(s[1].put_nowait, exc)
            except RuntimeError:
                pass

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded before any output."""
        reqs = self.make_requests(request_id, prompt_ids, params, anchors)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        if len(self.scheduler.waiting) + self._submit_q.qsize() >= self.config.scheduler.max_queued_requests:
            raise EngineOverloaded(f"the engine queue is full ({self.config.scheduler.max_queued_requests} "
                                   "requests waiting)")
        if self._thread is None:
            self.start()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._submit_q.put(reqs)
        self._wake.set()
        done: set[int] = set()
        try:
            while len(done) < len(reqs):
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    done.add(item.index)
                yield item
        finally:
            self._streams.pop(request_id, None)
            if len(done) < len(reqs):
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the next step."""
        if self._thread is None:
            if request_id in self._open:
                self.scheduler.abort(request_id)
            return
        self._abort_q.put(request_id)
        self._wake.set()

    # ---- introspection --------------------------------------------------------------------------
    def _refresh_stats(self) -> None:
        sched = self.scheduler
        uf, us = sched.kv.used_pages(sched.running)
        pools = {}
        for name, alloc, used in (("full_pool", self.full_alloc, uf), ("swa_pool", self.swa_alloc, us)):
            total, free = alloc.num_total, alloc.num_free
            pools[name] = {"total": total, "free": free, "used": used, "cached": total - free - used,
                           "usage": used / total if total else 0.0}
        self._stats = {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            **pools,
            "prefix_cache_query_tokens": sched.prefix_query_tokens,
            "prefix_cache_hit_tokens": sched.prefix_hit_tokens,
            "num_preemptions": sched.num_preemptions,
        }

    def stats(self) -> dict[str, Any]:
        """Snapshot taken after the last step (thread-safe)."""
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["waiting"] += self._submit_q.qsize()
        out["prompt_tokens_total"] = self.prompt_tokens_total
        out["generation_tokens_total"] = self.generation_tokens_total
        return out

    def flush_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while requests run or wait."""
        with self._step_lock:
            if self.scheduler.running or self.scheduler.waiting or self._submit_q.qsize() or self._open:
                return False
            self.cache.reset()
            self._refresh_stats()
            return True
