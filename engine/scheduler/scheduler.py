"""Continuous batching over the paged SWA cache (pure Python: no torch).

Each step: (1) decodes of running requests (1 token each), (2) the next chunk of running requests
still prefilling, (3) admission of waiting requests (cache.match + lock, then a first chunk), all
within a token budget (--chunked-prefill-size) and a cap on running requests. Admission goes in arrival
order, or with --admission-policy cache-aware a request that would evict a window about to hit may wait
while later ones go first (admission.py). With bidirectional image
attention a chunk never ends inside an image (Req.chunk_end): it stops before the image, or runs to the
image's end, past the budget when the image is longer than what is left of it. When the pools cannot
give pages even after the cache evicts, the newest running request is preempted: what it computed
goes into the cache, it returns to the front of the waiting queue with its tokens kept, and it later
resumes from what the cache still holds (outputs are unchanged).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from swaserve.engine.config import SchedulerConfig
from swaserve.engine.core import Batch, FinishReason, Req, ReqStatus, TokenLogprob
from swaserve.engine.scheduler.admission import Admission
from swaserve.engine.scheduler.encoder_budget import EncoderBudget
from swaserve.engine.scheduler.kv_manager import KVManager

log = logging.getLogger(__name__)

ADMIT_LOOKAHEAD = 32  # waiting requests one step may pass over for cache-aware admission (admission.py)


@dataclass
class StepOutput:
    """What one step did to one request: a new token (or none: a prefill chunk) and/or a finish (with no
    token: a max_tokens 0 request whose prompt is in)."""

    req: Req
    token_id: int | None
    logprob: TokenLogprob | None
    finished: bool


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVManager, context_length: int):
        self.cfg = cfg
        self.kv = kv
        self.context_length = context_length
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # oldest first (by arrival_seq)
        self._seq = itertools.count()
        self._aborts: set[str] = set()  # request ids
        self.num_preemptions = 0
        self.steps = 0  # schedule() calls (the clock of cache-aware admission's wait bound)
        self.admission = Admission(cfg, kv)  # who may wait for cold pages; the engine feeds its step costs
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_tier_hit_tokens = 0  # of the hits, tokens promoted from the second KV tier
        self.encoder_budget: EncoderBudget | None = None  # set by the engine builder with an image encoder

    # ---- requests in / out ------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.arrival_seq = next(self._seq)
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        self.kv.prefetch(req)  # a tier with a host level reads what its admission will promote meanwhile

    def abort(self, request_id: str) -> None:
        """Mark every choice of request_id; they finish with 'abort' at the start of the next step."""
        self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def finish(self, req: Req, reason: FinishReason, matched: str | int | None = None) -> None:
        """Finish a request now (stop string, abort, ...) and release its pages."""
        if req.finished:
            return
        req.finish_reason = reason
        req.matched_stop = matched
        if req.status == ReqStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.release(req, finished=True)
        req.status = ReqStatus.FINISHED

    def _process_aborts(self) -> list[Req]:
        if not self._aborts:
            return []
        ids, self._aborts = self._aborts, set()
        hit = [r for r in itertools.chain(self.running, self.waiting) if r.request_id in ids]
        for r in hit:
            self.finish(r, "abort")
        return hit

    # ---- scheduling -------------------------------------------------------------------------
    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req, finished=False)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted %s at %d tokens", req.rid, len(req.token_ids))

    def _grow_or_preempt(self, req: Req, new_len: int, plan: dict[Req, int]) -> bool:
        """Allocate for req; on failure preempt the newest running request (possibly req itself)."""
        while not self.kv.grow(req, new_len):
            victim = self.running[-1]
            self._preempt(victim)
            plan.pop(victim, None)
            if victim is req:
                return False
        return True

    def schedule(self) -> tuple[Batch | None, list[Req]]:
        """Plan one step. Returns the batch (None when there is nothing to run) and the requests
        that finished by abort since the last step."""
        aborted = self._process_aborts()
        self.steps += 1
        preempted_before = self.num_preemptions
        budget = self.cfg.chunked_prefill_size
        if self.encoder_budget is not None:
            self.encoder_budget.begin()
        plan: dict[Req, int] = {}  # req -> new tokens this step, in insertion order
        decodes = [r for r in self.running if r.num_computed == len(r.token_ids) - 1]
        prefills = [r for r in self.running if r.num_computed < len(r.token_ids) - 1]
        for r in decodes + prefills:
            if budget <= 0:
                break
            if r.status != ReqStatus.RUNNING:  # preempted in this loop
                continue
            q = self._chunk(r, r.num_computed, budget)
            if q == 0:  # its next image waits for the encoder budget of a later step
                continue
            if self._grow_or_preempt(r, r.num_computed + q, plan):
                plan[r] = q
                budget -= q
        budget = self.cfg.chunked_prefill_size - sum(plan.values())
        if budget > 0 and self.num_preemptions == preempted_before:  # no admission under pressure
            self._admit(budget, plan)
        if not plan:
            return None, aborted
        reqs = list(plan)
        return Batch(
            reqs=reqs,
            q_lens=[plan[r] for r in reqs],
            prefix_lens=[r.num_computed for r in reqs],
            # max_tokens 0: the chunk that ends the prompt samples nothing
            sample=[r.num_computed + plan[r] == len(r.token_ids) < r.max_len for r in reqs],
        ), aborted

    def _chunk(self, req: Req, start: int, budget: int) -> int:
        """Tokens of req's next chunk from `start` (0: none this step): what the budget allows, moved off an
        image (Req.chunk_end), then cut before the first image past this step's encoder budget
        (scheduler/encoder_budget.py; that cut lands on an image's start, so no chunk ends inside one)."""
        q = req.chunk_end(start, start + min(len(req.token_ids) - start, budget)) - start
        if self.encoder_budget is None or not req.images:
            return q
        return self.encoder_budget.fit(req, start, q)

    def _admit(self, budget: int, plan: dict[Req, int]) -> None:
        skipped: list[Req] = []
        deferred = 0  # of skipped, those waiting for cold pages (cache-aware admission)
        self.admission.begin()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting.popleft()
            if req.parent is not None and not (req.parent.prompt_cached or req.parent.finished):
                skipped.append(req)  # n > 1: wait for the first choice's prompt to be cached
                continue
            if self.admission.enabled and self.admission.defer(req, self.running, self.steps):
                skipped.append(req)
                deferred += 1
                if deferred >= ADMIT_LOOKAHEAD:
                    break
                continue
            reused = self.kv.admit(req)
            q = self._chunk(req, reused, budget)
            if q == 0 or not self.kv.grow(req, reused + q):
                self.kv.unadmit(req)
                self.waiting.appendleft(req)
                break
            if req.cached_tokens is None:  # first admission: the exact reuse reported to the user
                req.cached_tokens = min(reused, req.prompt_len)
                self.prefix_query_tokens += req.prompt_len
                self.prefix_hit_tokens += req.cached_tokens
                self.prefix_tier_hit_tokens += req.offload_cached
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            self.running.sort(key=lambda r: r.arrival_seq)
            plan[req] = q
            budget -= q
        self.waiting.extendleft(reversed(skipped))

    # ---- results ----------------------------------------------------------------------------
    def update(self, batch: Batch, tokens: list[int | None],
               logprobs: list[TokenLogprob | None] | None = None) -> list[StepOutput]:
        """Apply a step's results: advance KV lengths, append sampled tokens, finish on stop token
        ids / max length, insert finished prefill chunks into the cache."""
        outs: list[StepOutput] = []
        for b, req in enumerate(batch.reqs):
            if req.status != ReqStatus.RUNNING:  # aborted or finished meanwhile
                continue
            q, start = batch.q_lens[b], batch.prefix_lens[b]
            assert req.num_computed == start
            req.num_computed = start + q
            extend = not (q == 1 and start == len(req.token_ids) - 1)
            if not batch.sample[b] and req.num_computed == len(req.token_ids):  # max_tokens 0: done
                req.finish_reason = "length"
                self.running.remove(req)
                self.kv.release(req, finished=True)
                req.status = ReqStatus.FINISHED
                outs.append(StepOutput(req, None, None, True))
                continue
            if not batch.sample[b]:
                self.kv.cache_prefix(req)
                self.kv.drop_out_of_window(req)
                outs.append(StepOutput(req, None, None, False))
                continue
            tok = tokens[b]
            assert tok is not None
            req.token_ids.append(tok)
            lp = logprobs[b] if logprobs is not None else None
            reason: FinishReason | None = None
            if tok in req.stop_ids:
                reason, req.matched_stop = "stop", tok
            elif len(req.token_ids) >= req.max_len:
                reason = "length"
            if reason is not None:
                req.finish_reason = reason
                self.running.remove(req)
                self.kv.release(req, finished=True)
                req.status = ReqStatus.FINISHED
                outs.append(StepOutput(req, tok, lp, True))
                continue
            if extend:
                self.kv.cache_prefix(req)
            self.kv.drop_out_of_window(req)
            outs.append(StepOutput(req, tok, lp, False))
        return outs

    # ---- introspection ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Cache invariants plus free + used + cached == total for both pools (tests, debug)."""
        uf, us = self.kv.used_pages(self.running)
        self.kv.cache.check_integrity(used_full=uf, used_swa=us)

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions}
