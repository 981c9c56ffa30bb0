"""Comparison mode: one server per configuration, the same workload against each, ratios side by side."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from swaserve.bench.serve_client import wait_healthy
from swaserve.bench.serve_stats import RequestResult, sweep_rows

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, extra `swaserve serve` flags): the default policy, the seed engine's behaviour, no reuse.
DEFAULT_CONFIGS: list[tuple[str, list[str]]] = [
    ("lazy", []),
    ("eager16", ["--swa-retain-policy", "eager", "--swa-retain-budget", "16"]),
    ("naive", ["--cache-type", "naive"]),
]


def parse_config(spec: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` (e.g. `eager64=--swa-retain-policy eager --swa-retain-budget 64`) -> (name, argv)."""
    import shlex

    name, sep, flags = spec.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--config must be NAME=FLAGS, got {spec!r}")
    return name, shlex.split(flags)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `swaserve serve` subprocess on a free local port; use as a context manager."""

    name: str
    argv: list[str]  # flags after `serve`
    health_timeout: float = 900.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = ""

    @property
    def cmd(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-cache-report",
            *self.argv,
        ]

    def __enter__(self) -> ServerProcess:
        import asyncio

        d = self.log_dir or tempfile.mkdtemp(prefix="swaserve-bench-")
        os.makedirs(d, exist_ok=True)
        self.log_path = os.path.join(d, f"server-{self.name}.log")
        print(
            f"starting server {self.name}: {' '.join(self.cmd[1:])} (log {self.log_path})",
            file=sys.stderr,
            flush=True,
        )
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            asyncio.run(wait_healthy(self.url, self.health_timeout, alive=lambda: self.proc.poll() is None))
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(
                f"server {self.name}: {e}\n--- last lines of {self.log_path} ---\n{self.log_tail()}"
            ) from None
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def outputs_identical(runs: dict[str, list[RequestResult]]) -> tuple[bool, int, list[str]]:
    """Compare the generated text per (session key, turn) across configurations.

    Returns (identical, number of requests compared, descriptions of the first mismatches).
    """
    names = list(runs)
    maps = {n: {(r.key, r.turn): (r.ok, r.reasoning + "\x00" + r.text) for r in runs[n]} for n in names}
    keys = sorted(set().union(*(m.keys() for m in maps.values())))
    bad = []
    for k in keys:
        vals = [maps[n].get(k) for n in names]
        if any(v is None or not v[0] for v in vals) or len({v[1] for v in vals}) > 1:
            bad.append(
                f"{k[0]} turn {k[1]}: "
                + ", ".join(
                    f"{n}={'missing' if v is None else ('failed' if not v[0] else repr(v[1][-40:]))}"
                    for n, v in zip(names, vals)
                )
            )
    return not bad, len(keys), bad[:5]


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b <= 0:
        return None
    return a / b


def comparison(
    workload: str,
    focus: str,
    summaries: dict[str, dict],
    runs: dict[str, list[RequestResult]],
    sweep_n: dict[str, int] | None = None,
    divergence: dict[int, int] | None = None,
) -> tuple[str, dict]:
    """Side-by-side table of one workload across configurations, and the same as a dict for --json."""
    names = list(summaries)
    focus_ttft = {n: summaries[n]["ttft_by_tag"].get(focus, {}).get("mean") for n in names}
    focus_p50 = {n: summaries[n]["ttft_by_tag"].get(focus, {}).get("p50") for n in names}
    vs_naive = {n: _ratio(focus_ttft[n], focus_ttft.get("naive")) for n in names}
    eager_over = {n: _ratio(focus_ttft.get("eager16"), focus_ttft[n]) for n in names}
    w = max(12, *(len(n) + 2 for n in names))
    lines = [f"== {workload}: comparison ({focus} requests are the ones that can reuse) =="]
    lines.append(f"{'':<34}" + "".join(f"{n:>{w}}" for n in names))

    def row(label: str, vals: list[str]) -> None:
        lines.append(f"{label:<34}" + "".join(f"{v:>{w}}" for v in vals))

    row(f"TTFT [{focus}] mean (ms)", [_ms(focus_ttft[n]) for n in names])
    row(f"TTFT [{focus}] p50 (ms)", [_ms(focus_p50[n]) for n in names])
    for t in sorted({t for s in summaries.values() for t in s["ttft_by_tag"]} - {focus}):
        row(f"TTFT [{t}] mean (ms)", [_ms(summaries[n]["ttft_by_tag"].get(t, {}).get("mean")) for n in names])
    row("E2E mean (ms)", [_ms(summaries[n]["e2e"]["mean"]) for n in names])
    row("TPOT mean (ms)", [_ms(summaries[n]["tpot"]["mean"]) for n in names])
    row("output tokens/s", [f"{summaries[n]['output_token_throughput']:.2f}" for n in names])
    row(
        "cached / prompt tokens",
        [
            "-" if summaries[n]["cached_ratio"] is None else f"{summaries[n]['cached_ratio']:.3f}"
            for n in names
        ],
    )
    row(
        f"cached ratio [{focus}]",
        [
            f"{summaries[n]['cached_ratio_by_tag'][focus]:.3f}"
            if focus in summaries[n]["cached_ratio_by_tag"]
            else "-"
            for n in names
        ],
    )
    if "naive" in names:
        row(f"TTFT [{focus}] / naive", ["-" if vs_naive[n] is None else f"{vs_naive[n]:.3f}x" for n in names])
    if "eager16" in names:
        row(
            f"eager16 TTFT [{focus}] / this",
            ["-" if eager_over[n] is None else f"{eager_over[n]:.2f}x" for n in names],
        )
    sweep = {}
    if sweep_n:
        sweep = {n: {r["n"]: r for r in sweep_rows(runs[n], sweep_n, divergence)} for n in names}
        for n_val in sorted({k for s in sweep.values() for k in s}):
            cells = []
            for n in names:
                r = sweep[n].get(n_val)
                cells.append(
                    "-"
                    if r is None
                    else f"{'-' if r['cached'] is None else r['cached']}/{r['prompt']} {r['verdict']}"
                )
            d = (divergence or {}).get(n_val)
            at = "" if d is None else f" (diverges {d} before the end)"
            lines.append(
                f"N={n_val:>4}{at} 2nd cached/prompt: "
                + "  |  ".join(f"{n}: {c}" for n, c in zip(names, cells))
            )
    same, count, bad = outputs_identical(runs)
    lines.append(
        f"outputs identical across configurations (greedy): {'YES' if same else 'NO'} "
        f"({count} requests x {len(names)} configurations)"
    )
    lines.extend(f"  differs: {b}" for b in bad)
    data = {
        "focus_tag": focus,
        "ttft_focus_mean": focus_ttft,
        "ttft_focus_p50": focus_p50,
        "ttft_focus_vs_naive": vs_naive,
        "eager16_ttft_over_this": eager_over,
        "outputs_identical": same,
        "requests_compared": count,
        "mismatches": bad,
        "sweep": {n: list(v.values()) for n, v in sweep.items()},
    }
    return "\n".join(lines), data
