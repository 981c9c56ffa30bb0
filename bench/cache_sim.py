"""`swaserve bench cache`: the cache-level benchmark, workloads x SWA pool sizes x retention policies,
driven through the engine's own Scheduler and KVManager (engine/scheduler) over the real prefix cache,
with a fake model that returns each request's predetermined answer (no tensors). Reports the prompt
tokens reused per row and the ratio to keep-everything (a pool too large to ever evict), the upper bound.

    swaserve bench cache                  # the full table (page 16, window 1024)
    swaserve bench cache --json           # one JSON object per row
    swaserve bench cache --workload multiturn --windows 8,16 --policy lazy
    swaserve bench cache --kv-cache-memory-gb 2,4 --kv-cache-dtype q8_0   # pools of 2 and 4 GiB of q8_0 KV

`python -m swaserve.bench.cache_sim` takes the same flags.

Units: every row prints its pools as total windows (the SWA pool's tokens / window, what the running
requests hold included) and as GiB of gemma-4-26B-A4B KV in bf16 and in q8_0 (bench/cache_units.py), so a
row lines up with the engine's --kv-cache-memory-gb. Policies: `lazy` (message starts passed as a chat
client's are), `lazy-no-msg-anchors` (a raw-prompt client: /v1/completions, token ids; the cache's own
anchors stay), `lazy-no-anchors` (the ablation: no anchor of any kind), `eager-16` (the seed's), `eager-512`.

Pools: an SWA pool that holds `swa_pool_windows` windows of cache on top of what the running requests
need (each its window plus two pages, and one prefill chunk: the minimum engine/builder.py enforces),
and a full-attention pool of 4x as many tokens; `roomy` holds every trace's KV. With `--arena` the
same bytes form one arena both kinds share (the engine's layout: a block is one SWA page or 10 full
pages), so a row's `swa_pool_windows` names its memory, not a fixed split. Policies `X+tier` (lazy+tier,
eager-16+tier, eager-512+tier) are X with a second tier (engine/kvcache/tier/index.py) large enough for every
page of the trace: the pages a later request can use (engine/kvcache/tier/demotion.py) are written to it when
evicted or trimmed and promoted back at admission (its records are the fake model's KV, so --check covers
them); the JSON rows then count the pages written per kind. `--kv-dtype bf16,q8_0` runs every row once per
KV storage type at the same bytes: a row's windows name bf16 windows, and a type of fewer bytes a value
holds that many more pages (q8_0: 2 / 1.0625 = 1.88x, running requests' pages included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from swaserve.bench.cache_model import AnswerModel, SimTierIO
from swaserve.bench.cache_traces import WORKLOADS, TraceRequest, TraceShape, make_trace
from swaserve.bench.cache_units import (
    GIB_SUFFIX,
    KV_BYTES_PER_TOKEN,
    ROOMY,
    describe,
    kv_page_scale,
    pages_for_memory,
    parse_choices,
    parse_gib,
    parse_windows,
)
from swaserve.engine.config import SchedulerConfig
from swaserve.engine.core import Req, SamplingParams
from swaserve.engine.kvcache import Arena, PageAllocator, PagePool, SWARadixCache
from swaserve.engine.kvcache.tier.index import KVTier
from swaserve.engine.scheduler import KVManager, Scheduler, make_reqs

POLICIES = ("lazy", "lazy-no-msg-anchors", "lazy-no-anchors", "eager-16", "eager-512", "lazy+tier",
            "eager-16+tier", "eager-512+tier")
# lazy with a second tier (engine/kvcache/tier/index.py) that holds every page of the trace
TIER = "lazy+tier"
TIER_SUFFIX = "+tier"  # any policy with a second tier
KEEP_EVERYTHING = "keep-everything"
# a raw-prompt client (/v1/completions, token ids): no message starts; the cache's own anchors stay
NO_MESSAGE_ANCHORS = "lazy-no-msg-anchors"
NO_ANCHORS = "lazy-no-anchors"  # the ablation: no anchor of any kind
WINDOWS = ("4", "8", "16", "roomy")


@dataclass(frozen=True)
class Geometry:
    page_size: int = 16
    window: int = 1024
    chunk: int = 2048  # --chunked-prefill-size
    full_per_swa: int = 4  # full-pool tokens per SWA-pool token
    concurrency: int = 1  # requests in flight (the issue measures one at a time)
    arena: bool = False  # both kinds carved from one arena of the same bytes (the engine's layout)
    full_per_block: int = 10  # full pages per arena block (Gemma 4: an SWA token costs 10 full tokens)
    tier_blocks: int | None = None  # X+tier: the tier's blocks (None: enough for the whole trace)
    kv_dtype: str = "bf16"  # the pages' type: --windows N is N bf16 windows' bytes, a GiB size this type's
    page_scale: float = 1.0  # pages of kv_dtype in the bytes of one bf16 page (kv_page_scale)
    admission: str = "fcfs"  # --admission-policy
    admission_max_wait: int | None = None  # --admission-max-wait
    # the modelled step time, seconds = step_s + prompt tokens / prompt_tok_s: what the scheduler's
    # StepCosts is fed (the cache-aware wait bound) and each row's modelled_s; the default is
    # gemma-4-26B-A4B on 2 CPU threads (docs/benchmarks.md: 43.7 prompt tok/s, ~85 ms a decode step)
    prompt_tok_s: float = 43.7
    step_s: float = 0.085


@dataclass
class Row:
    workload: str
    policy: str
    swa_pool_windows: int | str
    reused_tokens: int
    reusable_tokens: int = 0  # keep-everything's reused tokens on the same trace
    prompt_tokens: int = 0
    evicted_swa_pages: int = 0
    evicted_full_pages: int = 0
    preemptions: int = 0
    steps: int = 0  # scheduler steps the trace took (a fake model: each prefills <= one chunk)
    modelled_s: float = 0.0  # the trace's time by the geometry's step-time model
    waits: list[int] = field(default_factory=list, repr=False)  # per request: steps from add to admission
    seconds: float = 0.0
    per_request: list[int] = field(default_factory=list, repr=False)
    memory: str = "split"  # "split": two pools; "arena": one arena of the same bytes
    tier: dict[str, Any] | None = None  # X+tier: the tier's counters at the end
    pool: dict[str, float] = field(default_factory=dict)  # cache_units.describe: total windows, GiB
    kv_dtype: str = "bf16"

    @property
    def ratio(self) -> float:
        return self.reused_tokens / self.reusable_tokens if self.reusable_tokens else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "policy": self.policy, "memory": self.memory,
                "kv_dtype": self.kv_dtype, "swa_pool_windows": self.swa_pool_windows, **self.pool,
                "reused_tokens": self.reused_tokens, "reusable_tokens": self.reusable_tokens,
                "ratio": round(self.ratio, 4), "prompt_tokens": self.prompt_tokens,
                "evicted_swa_pages": self.evicted_swa_pages, "evicted_full_pages": self.evicted_full_pages,
                "preemptions": self.preemptions, "steps": self.steps, "modelled_s": round(self.modelled_s, 1),
                "mean_wait_steps": round(sum(self.waits) / max(1, len(self.waits)), 2),
                "max_wait_steps": max(self.waits, default=0), "seconds": round(self.seconds, 2),
                **({"tier_promotions": self.tier["promotions"],
                    "tier_promoted_tokens": self.tier["promoted_tokens"],
                    "tier_pages_written": self.tier["pages_written_full"] + self.tier["pages_written_swa"],
                    "tier_pages_written_full": self.tier["pages_written_full"],
                    "tier_pages_written_swa": self.tier["pages_written_swa"],
                    "tier_pages_read_full": self.tier["pages_read_full"],
                    "tier_pages_read_swa": self.tier["pages_read_swa"]}
                   if self.tier else {})}


def running_pages(geo: Geometry) -> int:
    """SWA pages the running requests need (engine/builder.py's minimum): each its window and two pages,
    plus one prefill chunk."""
    per_req = -(-geo.window // geo.page_size) + 2
    return geo.concurrency * per_req + -(-geo.chunk // geo.page_size) + 1


def pool_pages(trace: Sequence[TraceRequest], windows: int | str, geo: Geometry) -> tuple[int, int]:
    """(full pages, SWA pages): an SWA pool of the bytes of `windows` bf16 windows of cache besides what the
    running requests need (in pages of geo.kv_dtype: times geo.page_scale), and a full pool of full_per_swa
    times as many tokens; "<G>GiB": split pools of G GiB of geo.kv_dtype KV in all (what
    --kv-cache-memory-gb gives); or a roomy pair."""
    if windows == ROOMY:
        total = sum(len(r.prompt) + len(r.answer) for r in trace) // geo.page_size + 1024
        return total, total
    if isinstance(windows, str) and windows.endswith(GIB_SUFFIX):
        full, swa = pages_for_memory(float(windows.removesuffix(GIB_SUFFIX)), geo.page_size, geo.full_per_swa,
                                     geo.kv_dtype)
        if swa < running_pages(geo):
            raise ValueError(f"{windows} of {geo.kv_dtype} KV cannot hold {geo.concurrency} running windows "
                             f"and a chunk ({running_pages(geo)} SWA pages of {geo.page_size} tokens)")
        return full, swa
    swa = int((int(windows) * geo.window // geo.page_size + running_pages(geo)) * geo.page_scale)
    return geo.full_per_swa * swa, swa


def build(policy: str, full_pages: int, swa_pages: int, geo: Geometry,
          tier: KVTier | None = None) -> tuple[Scheduler, SWARadixCache]:
    """The engine's scheduler and KV manager over a radix cache configured for `policy` (X+tier: X with
    `tier` as its second tier)."""
    fa: PagePool
    sa: PagePool
    if geo.arena:  # the same bytes as the split pools, shared: one block = one SWA page = k full pages
        arena = Arena(swa_pages + -(-full_pages // geo.full_per_block), geo.full_per_block)
        fa, sa = arena.full, arena.swa
    else:
        fa, sa = PageAllocator(full_pages), PageAllocator(swa_pages)
    base = policy.removesuffix(TIER_SUFFIX)
    kw: dict[str, Any] = {"policy": "lazy", "swa_retain_tokens": 512}
    if base == NO_ANCHORS:
        kw["anchors"] = False
    elif base.startswith("eager-") and base.removeprefix("eager-").isdigit():
        kw = {"policy": "eager", "swa_retain_tokens": int(base.removeprefix("eager-"))}
    elif base not in ("lazy", NO_MESSAGE_ANCHORS, KEEP_EVERYTHING):
        raise ValueError(f"unknown policy {policy!r}")
    cache = SWARadixCache(geo.page_size, geo.window, fa, sa, **kw)
    if policy.endswith(TIER_SUFFIX):
        assert tier is not None, f"{policy} needs a tier"
        cache.set_tier(tier)
    kv = KVManager(cache, fa, sa, geo.page_size, geo.window)
    cfg = SchedulerConfig(max_running_requests=max(geo.concurrency, 1), chunked_prefill_size=geo.chunk,
                          admission_policy=geo.admission, admission_max_wait=geo.admission_max_wait)
    return Scheduler(cfg, kv, context_length=1 << 30), cache


def simulate(workload: str, trace: Sequence[TraceRequest], policy: str, windows: int | str, geo: Geometry,
             check: bool = False) -> Row:
    """Serve the trace in order (at most geo.concurrency requests in flight) and count reused tokens."""
    t0 = time.perf_counter()
    full_pages, swa_pages = pool_pages(trace, ROOMY if policy == KEEP_EVERYTHING else windows, geo)
    model = AnswerModel(geo.page_size, geo.window, check=check)
    tier = None
    if policy.endswith(TIER_SUFFIX):  # blocks: one SWA page or full_per_block full pages; room for the trace
        roomy_full, roomy_swa = pool_pages(trace, ROOMY, geo)
        blocks = geo.tier_blocks or roomy_swa + -(-roomy_full // geo.full_per_block)
        tier = KVTier(SimTierIO(model, geo.full_per_block), blocks, geo.full_per_block, name="sim")
    sched, cache = build(policy, full_pages, swa_pages, geo, tier)
    pass_anchors = policy.removesuffix(TIER_SUFFIX) not in (NO_MESSAGE_ANCHORS, NO_ANCHORS)
    pending = deque(enumerate(trace))
    done: list[Req] = []
    in_flight: list[Req] = []
    added: dict[str, int] = {}  # rid -> the step it was added at
    waits: dict[str, int] = {}  # rid -> steps until its first admission
    steps = 0
    modelled = 0.0  # seconds, by the geometry's step-time model
    while pending or in_flight:
        while pending and len(in_flight) < geo.concurrency:
            i, tr = pending.popleft()
            params = SamplingParams(max_tokens=len(tr.answer), temperature=0.0, ignore_eos=True)
            (req,) = make_reqs(f"r{i}", list(tr.prompt), params, context_length=1 << 30, eos_ids=(), seed=0,
                               anchors=tr.anchors if pass_anchors else ())
            model.answers[req.rid] = tr.answer
            sched.add(req)
            in_flight.append(req)
            added[req.rid] = steps
        batch, _ = sched.schedule()
        steps += 1
        if batch is not None:
            seconds = geo.step_s + batch.prefill_tokens / geo.prompt_tok_s
            sched.admission.costs.record(batch.prefill_tokens, seconds)
            modelled += seconds
        for r in in_flight:
            if r.cached_tokens is not None and r.rid not in waits:
                waits[r.rid] = steps - 1 - added[r.rid]
        if batch is None:
            raise RuntimeError("the scheduler stalled with requests in flight")
        sched.update(batch, model(batch))
        if check:
            sched.check_integrity()
        for r in [r for r in in_flight if r.finished]:
            in_flight.remove(r)
            done.append(r)
    done.sort(key=lambda r: int(r.rid[1:]))
    st = cache.stats()
    if policy == KEEP_EVERYTHING:
        assert st["evicted_swa_pages"] == st["evicted_full_pages"] == 0, "keep-everything evicted"
    if tier is not None:  # nothing leaked: every page returns once the cache is flushed
        sched.check_integrity()
        assert not sched.running and cache.full_locked == 0, "pages still locked after the trace"
        st = cache.stats()
        cache.reset()
        kv = sched.kv
        assert kv.full_alloc.num_used == kv.swa_alloc.num_used == 0, "pages leaked"
        tier.check()
    return Row(workload, policy, windows, sum(r.cached_tokens or 0 for r in done),
               pool=describe(full_pages, swa_pages, geo.page_size, geo.window),
               prompt_tokens=sum(len(t.prompt) for t in trace), evicted_swa_pages=st["evicted_swa_pages"],
               evicted_full_pages=st["evicted_full_pages"], preemptions=sched.num_preemptions,
               steps=steps, modelled_s=modelled, waits=[waits.get(r.rid, 0) for r in done],
               seconds=time.perf_counter() - t0, per_request=[r.cached_tokens or 0 for r in done],
               memory="arena" if geo.arena else "split", tier=tier.stats() if tier is not None else None,
               kv_dtype=geo.kv_dtype)


def run_table(workloads: Sequence[str], policies: Sequence[str], windows: Sequence[int | str], geo: Geometry,
              shape: TraceShape | None = None, check: bool = False, progress: bool = False) -> list[Row]:
    """Every (workload, pool, policy) row, plus one keep-everything row per workload (its upper bound)."""
    rows: list[Row] = []
    for w in workloads:
        trace = make_trace(w, shape)
        upper = simulate(w, trace, KEEP_EVERYTHING, ROOMY, geo, check=check)
        upper.reusable_tokens = upper.reused_tokens
        rows.append(upper)
        for win in windows:
            for pol in policies:
                row = simulate(w, trace, pol, win, geo, check=check)
                row.reusable_tokens = upper.reused_tokens
                rows.append(row)
                if progress:
                    print(f"  {w:11s} {str(win):>5s} {pol:16s} ratio {row.ratio:.3f} ({row.seconds:.1f}s)",
                          file=sys.stderr, flush=True)
    return rows


def format_table(rows: Sequence[Row], policies: Sequence[str]) -> str:
    """One line per (workload, pool): each policy's ratio to keep-everything (reused tokens in brackets)."""
    head = f"{'workload':11s} {'windows':>10s} {'total':>6s} {'GiB bf16':>8s} {'q8_0':>6s}  " + \
        "  ".join(f"{p:>18s}" for p in policies)
    lines = [head, "-" * len(head)]
    by_key: dict[tuple[str, str], dict[str, Row]] = {}
    several = len({r.kv_dtype for r in rows}) > 1  # windows column: "4 q8_0" (bf16 windows' bytes)
    uppers: dict[str, Row] = {}
    for r in rows:
        if r.policy == KEEP_EVERYTHING:
            uppers[r.workload] = r
        else:
            win = f"{r.swa_pool_windows} {r.kv_dtype}" if several else str(r.swa_pool_windows)
            by_key.setdefault((r.workload, win), {})[r.policy] = r
    for (w, win), cells in by_key.items():
        vals = [f"{cells[p].ratio:6.3f} ({cells[p].reused_tokens:>7d})" if p in cells else f"{'-':>18s}"
                for p in policies]
        u = next(iter(cells.values())).pool
        units = f"{u['total_windows']:6.1f} {u['gib_bf16']:8.2f} {u['gib_q8_0']:6.2f}"
        lines.append(f"{w:11s} {win:>10s} {units}  " + "  ".join(vals))
    lines.append("")
    lines.append("windows: of cache beyond the running requests' (or a --kv-cache-memory-gb size); total: "
                 "the SWA pool's windows, running ones included; GiB: gemma-4-26B-A4B KV of those pools, "
                 "bf16 / q8_0")
    lines.append("keep-everything (reusable tokens): " + ", ".join(
        f"{w} {u.reused_tokens} of {u.prompt_tokens} prompt tokens" for w, u in uppers.items()))
    return "\n".join(lines)


def _step_costs(text: str) -> tuple[float, float]:
    try:
        tok_s, step_s = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step-costs {text!r}: expected PROMPT_TOK_S,STEP_S") from None
    if tok_s <= 0 or step_s <= 0:
        raise argparse.ArgumentTypeError(f"--step-costs {text!r}: both must be positive")
    return tok_s, step_s


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", type=lambda s: parse_choices(s, WORKLOADS, "--workload"),
                   default=list(WORKLOADS),
                   help=f"comma-separated (default all): {', '.join(WORKLOADS)}")
    p.add_argument("--policy", type=lambda s: parse_choices(s, POLICIES, "--policy"), default=list(POLICIES),
                   help=f"comma-separated (default all): {', '.join(POLICIES)}")
    p.add_argument("--windows", type=parse_windows, default=[4, 8, 16, ROOMY],
                   help="SWA pool sizes in windows, comma-separated (default 4,8,16,roomy)")
    p.add_argument("--kv-cache-memory-gb", type=parse_gib, default=[],
                   help="more pool sizes, in GiB of gemma-4-26B-A4B KV in all (split pools, full tokens 4x "
                        "SWA tokens), comma-separated: what the engine's --kv-cache-memory-gb gives")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    p.add_argument("--admission-policy", choices=("fcfs", "cache-aware"), default="fcfs",
                   help="the engine's --admission-policy (default here fcfs, strict arrival order, so that "
                        "earlier tables reproduce; the engine's default, auto, is cache-aware on CPU)")
    p.add_argument("--admission-max-wait", type=int, default=None,
                   help="the engine's --admission-max-wait: a cap on cache-aware waiting, in steps")
    p.add_argument("--step-costs", type=_step_costs, default=(43.7, 0.085),
                   help="PROMPT_TOK_S,STEP_S: the modelled step time (prompt tokens per second, seconds a "
                        "step), fed to cache-aware admission's bound and summed per row (default 43.7,0.085: "
                        "gemma-4-26B-A4B on 2 CPU threads)")
    p.add_argument("--arena", action="store_true",
                   help="carve both kinds from one arena of the same bytes (a block: one SWA page or 10 "
                        "full pages)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype",
                   type=lambda s: parse_choices(s, tuple(KV_BYTES_PER_TOKEN), "--kv-dtype"),
                   default=["bf16"], help="KV types of the pages, comma-separated (default bf16): a "
                   "--windows size is bf16 windows' bytes, a --kv-cache-memory-gb size GiB of each type")
    p.add_argument("--check", action="store_true",
                   help="verify every KV read of the fake model and the cache invariants after every step")
    p.add_argument("--json", action="store_true", help="one JSON object per row on stdout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swaserve.bench.cache_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cache_args(p)
    return p


def _flag_error(args: argparse.Namespace) -> str | None:
    if args.admission_max_wait is not None and args.admission_max_wait < 0:
        return "--admission-max-wait must be at least 0"
    return "--concurrency must be at least 1" if args.concurrency < 1 else None


def run_cache(args: argparse.Namespace) -> int:
    """Run the table the parsed flags name and print it (or its JSON rows); ValueError for a bad flag."""
    error = _flag_error(args)
    if error is not None:
        raise ValueError(error)
    rows = []
    for kv in args.kv_dtype:
        geo = Geometry(concurrency=args.concurrency, arena=args.arena, kv_dtype=kv,
                       page_scale=kv_page_scale(kv), admission=args.admission_policy,
                       admission_max_wait=args.admission_max_wait, prompt_tok_s=args.step_costs[0],
                       step_s=args.step_costs[1])
        rows += run_table(args.workload, args.policy, [*args.windows, *args.kv_cache_memory_gb], geo,
                          check=args.check, progress=not args.json)
    if args.json:
        for r in rows:
            print(json.dumps(r.to_json()))
    else:
        print(format_table(rows, args.policy))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m swaserve.bench.cache_sim`: the flags and output of `swaserve bench cache`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    error = _flag_error(args)
    if error is not None:
        parser.error(error)
    return run_cache(args)


if __name__ == "__main__":
    sys.exit(main())
