"""Benchmark statistics: per-request results, percentiles, per-run summaries and text tables."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PCTS = (50, 90, 99)


@dataclass
class RequestResult:
    key: str
    turn: int
    tag: str
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    ttft: float | None = None  # seconds from send to the first generated text
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks (s)
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    start: float = 0.0  # perf_counter at send
    end: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def to_json(self, with_text: bool = True) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        if not with_text:
            d.pop("text")
            d.pop("reasoning")
        return d


def percentile(values: list[float], q: float) -> float:
    """q-th percentile with linear interpolation (numpy's default method)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (nan when empty)."""
    d = {"mean": sum(values) / len(values) if values else math.nan}
    for p in PCTS:
        d[f"p{p}"] = percentile(values, p)
    d["n"] = len(values)
    return d


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Latency distributions (seconds), throughput and cache ratio of one workload run."""
    ok = [r for r in results if r.ok]
    tags = sorted({r.tag for r in results})
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    s = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "ttft": dist([r.ttft for r in ok if r.ttft is not None]),
        "ttft_by_tag": {t: dist([r.ttft for r in ok if r.tag == t and r.ttft is not None]) for t in tags},
        "tpot": dist([r.tpot for r in ok if r.tpot is not None]),
        "itl": dist([x for r in ok for x in r.itl]),
        "e2e": dist([r.e2e for r in ok]),
        "e2e_by_tag": {t: dist([r.e2e for r in ok if r.tag == t]) for t in tags},
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "input_token_throughput": prompt / duration if duration > 0 else math.nan,
        "output_token_throughput": completion / duration if duration > 0 else math.nan,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": sum(r.cached_tokens for r in reported) if reported else None,
        "cached_ratio": (
            sum(r.cached_tokens for r in reported) / max(1, sum(r.prompt_tokens for r in reported))
            if reported
            else None
        ),
        "cached_ratio_by_tag": {},
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for t in tags:
        rep = [r for r in reported if r.tag == t]
        if rep:
            s["cached_ratio_by_tag"][t] = sum(r.cached_tokens for r in rep) / max(
                1, sum(r.prompt_tokens for r in rep)
            )
    return s


def reuse_label(cached: int | None, prompt_tokens: int) -> str:
    """The seed's verdict for the second request of a sweep case."""
    if cached is None:
        return "NOT REPORTED"
    if cached == 0:
        return "NO REUSE"
    return "REUSED" if cached >= prompt_tokens / 2 else "PARTIAL"


def sweep_rows(
    results: list[RequestResult], sweep_n: dict[str, int], divergence: dict[int, int] | None = None
) -> list[dict]:
    """One row per N: the second request's cached and prompt tokens and the verdict.

    `divergence[N]`, when known, is how many tokens before the first prompt's end the second one diverges.
    """
    rows = []
    for r in results:
        if r.tag != "sweep-b" or r.key not in sweep_n:
            continue
        rows.append(
            {
                "n": sweep_n[r.key],
                "ok": r.ok,
                "cached": r.cached_tokens,
                "prompt": r.prompt_tokens,
                "ttft": r.ttft,
                "verdict": reuse_label(r.cached_tokens, r.prompt_tokens) if r.ok else "FAILED",
                "diverges": (divergence or {}).get(sweep_n[r.key]),
            }
        )
    return sorted(rows, key=lambda x: x["n"])


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_summary(title: str, s: dict, sweep: list[dict] | None = None) -> str:
    """A text table of one run."""
    lines = [
        f"== {title} ==  {s['completed']}/{s['requests']} ok, {s['failed']} failed, {s['duration_s']:.2f} s"
    ]
    lines.append(f"{'latency (ms)':<26}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>6}")

    def row(name: str, d: dict) -> None:
        lines.append(
            f"{name:<26}"
            + "".join(f"{_ms(d[k]):>10}" for k in ("mean", "p50", "p90", "p99"))
            + f"{d['n']:>6}"
        )

    row("TTFT", s["ttft"])
    if len(s["ttft_by_tag"]) > 1:
        for t, d in s["ttft_by_tag"].items():
            row(f"  TTFT [{t}]", d)
    row("TPOT", s["tpot"])
    row("ITL", s["itl"])
    row("E2E", s["e2e"])
    lines.append(f"request throughput        {_num(s['request_throughput'])} req/s")
    lines.append(
        f"token throughput          {_num(s['input_token_throughput'], '{:.1f}')} in/s, "
        f"{_num(s['output_token_throughput'], '{:.1f}')} out/s"
    )
    if s["cached_ratio"] is None:
        lines.append(
            f"cached tokens             not reported (start the server with --enable-cache-report); "
            f"{s['prompt_tokens']} prompt tokens"
        )
    else:
        by_tag = ", ".join(f"{t} {v:.3f}" for t, v in s["cached_ratio_by_tag"].items())
        lines.append(
            f"cached tokens             {s['cached_tokens']} / {s['prompt_tokens']} prompt = "
            f"{s['cached_ratio']:.3f}" + (f"  ({by_tag})" if len(s["cached_ratio_by_tag"]) > 1 else "")
        )
    for e in s["errors"]:
        lines.append(f"error: {e}")
    for r in sweep or []:
        cached = "-" if r["cached"] is None else r["cached"]
        at = (
            ""
            if r.get("diverges") is None
            else f"  (diverges {r['diverges']} tokens before the 1st prompt's end)"
        )
        lines.append(f"N={r['n']:>4} -> 2nd cached {cached:>6} of {r['prompt']:>6}  {r['verdict']:<9}{at}")
    return "\n".join(lines)
