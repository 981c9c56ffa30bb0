"""Cache-aware admission (`--admission-policy cache-aware`, pure Python): which waiting request may pass
another, and for how long.

Eviction can only choose among unlocked windows. With several misses in flight, each one's new window is
locked while the others allocate, so the unlocked windows that go are the ones that just hit. Under cyclic
reuse those are the furthest from their next use, and the stable set of windows that keeps hitting
shrinks (docs/cache.md, "Eviction"). So while other requests run, a waiting request is admitted only if
its pages can come from free pages and from cached pages that no *hot* window needs (a non-redundant
anchor whose reuse is due: PrefixCache.hot_windows). Otherwise it waits and later requests that fit go
first. Its pages are at most its window plus one chunk (KVManager.swa_need); the room keeps back one chunk
for each running request.

It waits only while waiting is cheaper than the recompute it saves. A hit through a hot window saves about
`tokens` prompt tokens (the hot windows' mean reuse length). A waiting step costs about one step whose
budget goes partly unused. So the bound is tokens x (seconds per prompt token) / (seconds per step), from
the step times the engine measures (StepCosts). On CPU that is hundreds to thousands of steps, on a GPU a
few tens. `--admission-max-wait N` caps it, or sets it while nothing has been measured yet; without N
nothing waits until both costs are known. Nothing waits with a second KV tier either (evicted windows come
back from it, and the check cannot see what it would promote), nor with a cache that reuses nothing
(--cache-type naive).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swaserve.engine.config import SchedulerConfig
    from swaserve.engine.core import Req
    from swaserve.engine.scheduler.kv_manager import KVManager

EMA = 0.1  # weight of the newest step in the cost averages


class StepCosts:
    """Moving averages of what a step costs: `step_s`, the seconds of a step without a prefill chunk, and
    `token_s`, the seconds each prompt token adds on top (None until measured)."""

    def __init__(self) -> None:
        self.step_s: float | None = None
        self.token_s: float | None = None
        self._first: tuple[int, float] | None = None  # a prefill step seen before any decode-only step

    def record(self, prefill_tokens: int, seconds: float) -> None:
        """One step's wall time and the prompt tokens it computed (0: decodes only)."""
        if prefill_tokens <= 0:
            self.step_s = seconds if self.step_s is None else (1 - EMA) * self.step_s + EMA * seconds
            if self._first is not None:
                self._first, first = None, self._first
                self.record(*first)
        elif self.step_s is None:
            self._first = (prefill_tokens, seconds)
        else:
            per = max(0.0, seconds - self.step_s) / prefill_tokens
            self.token_s = per if self.token_s is None else (1 - EMA) * self.token_s + EMA * per

    def steps_worth(self, tokens: int) -> int | None:
        """Steps that cost what recomputing `tokens` prompt tokens does (None: not measured yet)."""
        if self.step_s is None or self.token_s is None or self.step_s <= 0:
            return None
        return int(tokens * self.token_s / self.step_s)


class Admission:
    """The waiting rule of one scheduler (module docstring). The cold room and the wait bound are per
    admission pass: begin() clears them, and the hot windows are counted at most once a pass."""

    def __init__(self, cfg: SchedulerConfig, kv: KVManager):
        self.cfg = cfg
        self.kv = kv
        self.costs = StepCosts()
        self._cold: int | None = None  # SWA pages this pass may still admit cold (None: not counted yet)
        self._bound = 0  # steps a request may wait, counted with _cold
        self.waited = 0  # requests that waited at least one step

    @property
    def enabled(self) -> bool:
        return self.cfg.admission_policy == "cache-aware"

    def stats(self) -> dict[str, object]:
        c = self.costs
        return {"policy": self.cfg.admission_policy, "waited_requests": self.waited,
                "step_ms": None if c.step_s is None else round(1e3 * c.step_s, 3),
                "prompt_token_ms": None if c.token_s is None else round(1e3 * c.token_s, 4)}

    def begin(self) -> None:
        self._cold = None

    def defer(self, req: Req, running: Sequence[Req], step: int) -> bool:
        """Whether req waits this step (it records when it first did in req.deferred_at)."""
        kv = self.kv
        if not running or kv.tier is not None or not kv.cache.reuses_prefixes:
            return False
        chunk = self.cfg.chunked_prefill_size
        need = kv.swa_need(req, chunk)
        if need > kv.swa_alloc.num_free:
            if self._cold is None:
                hot_pages, hot_tokens = kv.cache.hot_windows()
                self._cold = kv.cold_room(hot_pages) - sum(kv.swa_growth(r, chunk) for r in running)
                self._bound = self._wait_bound(hot_tokens)
            waited = 0 if req.deferred_at is None else step - req.deferred_at
            if need > self._cold and waited < self._bound:
                if req.deferred_at is None:
                    req.deferred_at = step
                    self.waited += 1
                return True
        if self._cold is not None:
            self._cold -= need
        return False

    def _wait_bound(self, hot_tokens: int) -> int:
        """Steps a request may wait: what recomputing a hot window's reuse costs, capped by
        --admission-max-wait (which alone bounds it while the costs are unmeasured)."""
        cap = self.cfg.admission_max_wait
        worth = self.costs.steps_worth(hot_tokens)
        if worth is None:
            return cap or 0
        return worth if cap is None else min(cap, worth)
