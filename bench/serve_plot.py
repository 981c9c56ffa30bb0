"""`swaserve bench serve --plot DIR`: PNG charts of a benchmark run (matplotlib, the optional extra `plot`).

  ttft.png          median TTFT per request kind (first / non-first / follow-up / ...) and configuration,
                    one panel per workload, with the 90th percentile as a whisker
  sweep.png         the divergence sweep: tokens reused by the second request against N, one line per
                    configuration (retention policy)
  cached-share.png  cached share of each request's prompt over the run's time, one panel per workload,
                    one series per configuration
"""

from __future__ import annotations

import os
from typing import Any

from swaserve.bench.serve_stats import RequestResult, percentile

Series = dict[str, tuple[list, list]]  # configuration -> (x values, y values)


def check_matplotlib() -> None:
    """ValueError (one line from the CLI) when matplotlib is missing; called before anything runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'swaserve[plot]'") from None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _workloads(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in runs))


def _configs(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["config"] for r in runs))


def ttft_series(runs: list[dict], workload: str) -> tuple[list[str], Series]:
    """(request kinds, {config: (median TTFT ms per kind, p90 per kind)}); 0.0 where a kind has no TTFT."""
    mine = {r["config"]: r["results"] for r in runs if r["workload"] == workload}
    tags = list(dict.fromkeys(x.tag for res in mine.values() for x in res))
    out = {}
    for cfg, res in mine.items():
        med, p90 = [], []
        for tag in tags:
            ttfts = [x.ttft * 1e3 for x in res if x.ok and x.tag == tag and x.ttft is not None]
            med.append(percentile(ttfts, 50) if ttfts else 0.0)
            p90.append(percentile(ttfts, 90) if ttfts else 0.0)
        out[cfg] = (med, p90)
    return tags, out


def plot_ttft(runs: list[dict], path: str) -> str:
    plt = _pyplot()
    names = _workloads(runs)
    configs = _configs(runs)
    fig, axes = plt.subplots(1, len(names), figsize=(4.8 * len(names), 3.6), squeeze=False)
    for ax, wl in zip(axes[0], names):
        tags, series = ttft_series(runs, wl)
        width = 0.8 / max(1, len(configs))
        for i, cfg in enumerate(configs):
            if cfg not in series:
                continue
            med, p90 = series[cfg]
            xs = [t + (i - (len(configs) - 1) / 2) * width for t in range(len(tags))]
            ax.bar(xs, med, width, label=cfg)
            ax.errorbar(xs, med, yerr=[[0] * len(med), [max(0.0, b - a) for a, b in zip(med, p90)]],
                        fmt="none", ecolor="black", capsize=3, linewidth=0.8)
        ax.set_xticks(range(len(tags)), tags)
        ax.set_title(wl)
        ax.set_ylabel("TTFT, ms (median; whisker: p90)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(title="configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_series(runs: list[dict], divergence: dict[int, int]) -> tuple[Series, dict[int, int]]:
    """({config: (N values, tokens the second request reused)}, {N: the second request's prompt tokens})."""
    from swaserve.bench.serve_stats import sweep_rows

    out: Series = {}
    prompts: dict[int, int] = {}
    for r in runs:
        if not r.get("sweep_n"):
            continue
        rows = [row for row in sweep_rows(r["results"], r["sweep_n"], divergence)
                if row["ok"] and row["cached"] is not None]
        out[r["config"]] = ([row["n"] for row in rows], [row["cached"] for row in rows])
        for row in rows:
            prompts[row["n"]] = max(prompts.get(row["n"], 0), row["prompt"])
    return out, prompts


def plot_sweep(runs: list[dict], divergence: dict[int, int], path: str) -> str | None:
    series, prompts = sweep_series(runs, divergence)
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for cfg, (ns, cached) in series.items():
        ax.plot(ns, cached, marker="o", label=cfg)
    all_n = sorted({n for ns, _ in series.values() for n in ns})
    if all_n and all_n[0] > 0 and all_n[-1] >= 10 * all_n[0]:  # N spans decades (the seed's 3 ... 256)
        ax.set_xscale("log")
        ax.set_xticks(all_n, [str(n) for n in all_n])
        ax.minorticks_off()
    if prompts:
        ns = sorted(prompts)
        ax.plot(ns, [prompts[n] for n in ns], color="grey", linestyle=":", linewidth=1,
                label="prompt tokens (2nd request)")
    ax.set_xlabel("N: the second request diverges N tokens before the first one's end")
    ax.set_ylabel("tokens reused (cached_tokens)")
    ax.set_title("divergence sweep")
    ax.grid(alpha=0.3)
    ax.legend(title="configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cached_share_series(runs: list[dict], workload: str) -> Series:
    """{config: (seconds since the workload's first request, cached / prompt tokens)} per request sent."""
    out = {}
    for r in runs:
        if r["workload"] != workload:
            continue
        res: list[RequestResult] = [x for x in r["results"]
                                    if x.ok and x.prompt_tokens and x.cached_tokens is not None]
        if not res:
            continue
        t0 = min(x.start for x in r["results"])
        res.sort(key=lambda x: x.start)
        out[r["config"]] = ([x.start - t0 for x in res], [x.cached_tokens / x.prompt_tokens for x in res])
    return out


def plot_cached_share(runs: list[dict], path: str) -> str:
    plt = _pyplot()
    names = _workloads(runs)
    fig, axes = plt.subplots(1, len(names), figsize=(4.8 * len(names), 3.4), squeeze=False)
    for ax, wl in zip(axes[0], names):
        for cfg, (xs, ys) in cached_share_series(runs, wl).items():
            ax.plot(xs, ys, marker=".", linestyle="-", linewidth=0.8, label=cfg)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(wl)
        ax.set_xlabel("seconds since the workload started")
        ax.set_ylabel("cached share of the prompt")
        ax.grid(alpha=0.3)
    axes[0][0].legend(title="configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: list[dict], divergence: dict[int, int], out_dir: str) -> list[str]:
    """Every chart the runs allow, as PNGs in out_dir; returns their paths."""
    if not runs:
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_ttft(runs, os.path.join(out_dir, "ttft.png"))]
    sweep = plot_sweep(runs, divergence, os.path.join(out_dir, "sweep.png"))
    if sweep:
        paths.append(sweep)
    paths.append(plot_cached_share(runs, os.path.join(out_dir, "cached-share.png")))
    return paths
