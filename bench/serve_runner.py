"""The benchmark's driver: builds the workloads once, runs them against each server (one after the other,
or interleaved request by request), prints and collects the results."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random

import httpx

from swaserve.bench import workloads as W
from swaserve.bench.serve_client import (
    RunConfig,
    chat_request,
    count_tokens,
    model_id,
    run_interleaved,
    run_workload,
    tokenize_chat,
)
from swaserve.bench.serve_compare import comparison
from swaserve.bench.serve_stats import RequestResult, format_summary, summarize, sweep_rows

log = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_WORD = 1.3


async def _calibrate(url: str, model: str, headers: dict, seed: int) -> tuple[float, float] | None:
    """Tokens per word of the random vocabulary and of the seed's filler, from POST /tokenize."""
    words = W.random_text(random.Random(seed), 2000, 1.0)
    filler = W.SEED_FILLER * 20
    async with httpx.AsyncClient(timeout=60.0) as c:
        a = await count_tokens(c, url, model, words, headers)
        b = await count_tokens(c, url, model, filler, headers)
    if not a or not b:
        return None
    return a / len(words.split()), b / len(filler.split())


async def _divergence(url: str, model: str, headers: dict, wl: W.Workload) -> dict[int, int]:
    """Per sweep N: tokens between the common prefix of the two rendered prompts and the first's end."""
    by_n: dict[int, list[list[dict]]] = {}
    for ph in wl.phases:
        for s in ph.sessions:
            by_n.setdefault(wl.sweep_n[s.key], []).append(
                [{"role": "system", "content": s.system}, {"role": "user", "content": s.turns[0].user}]
            )
    out = {}
    async with httpx.AsyncClient(timeout=60.0) as c:
        for n, (ma, mb) in by_n.items():
            a = await tokenize_chat(c, url, model, ma, headers)
            b = await tokenize_chat(c, url, model, mb, headers)
            if a is None or b is None:
                return {}
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out[n] = len(a) - common
    return out


async def _model_name(url: str, headers: dict) -> str:
    async with httpx.AsyncClient(timeout=30.0) as c:
        return await model_id(c, url, headers)


def build_workloads(
    args: argparse.Namespace, names: list[str], tpw: float, tpw_filler: float
) -> list[W.Workload]:
    out = []
    for n in names:
        if n in ("fanout", "fanout-image"):
            out.append(
                W.fanout(
                    args.num_groups,
                    args.prompts_per_group,
                    args.system_prompt_len,
                    args.question_len,
                    args.output_len,
                    tpw,
                    args.seed,
                    image_size=getattr(args, "image_size", 224) if n == "fanout-image" else 0,
                )
            )
        elif n == "append":
            out.append(
                W.multi_turn(
                    args.num_sessions,
                    args.num_turns,
                    args.system_prompt_len,
                    args.question_len,
                    args.output_len,
                    tpw,
                    args.seed,
                )
            )
        elif n == "sweep":
            out.append(
                W.divergence_sweep(args.sweep_n, args.sweep_prefix_len, args.sweep_output_len, tpw_filler)
            )
        else:
            out.append(
                W.random_prompts(
                    args.num_prompts,
                    args.random_input_len,
                    args.random_output_len,
                    args.random_range_ratio,
                    tpw,
                    args.seed,
                )
            )
    return out


def _encoder_runs(url: str, headers: dict) -> float | None:
    """The server's image encoder runs so far (GET /metrics), None without an encoder."""
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("swaserve:image_encoder_runs_total"):
            return float(line.rsplit(" ", 1)[1])
    return None


class BenchRunner:
    """Runs every workload against each server and collects the records."""

    def __init__(self, args: argparse.Namespace, names: list[str]):
        self.args, self.names = args, names
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.workloads: list[W.Workload] | None = None
        self.runs: list[dict] = []
        self.tpw: tuple[float, float] | None = None
        self.divergence: dict[int, int] = {}  # sweep N -> tokens before the 1st prompt's end (from /tokenize)

    def _connect(self, url: str) -> RunConfig:
        """The request settings for one server; builds the workloads from the first one (so every
        configuration gets the same prompts) and sends the warmup requests."""
        a = self.args
        model = a.served_model_name or asyncio.run(_model_name(url, self.headers))
        if self.workloads is None:
            if a.tokens_per_word is not None:
                self.tpw = (a.tokens_per_word, a.tokens_per_word)
            else:
                self.tpw = asyncio.run(_calibrate(url, model, self.headers, a.seed))
                if self.tpw is None:
                    log.warning(
                        "POST /tokenize unavailable: assuming %.2f tokens/word", DEFAULT_TOKENS_PER_WORD
                    )
                    self.tpw = (DEFAULT_TOKENS_PER_WORD, DEFAULT_TOKENS_PER_WORD)
            self.workloads = build_workloads(a, self.names, *self.tpw)
            for wl in self.workloads:
                if wl.sweep_n:
                    self.divergence = asyncio.run(_divergence(url, model, self.headers, wl))
        extra = {"chat_template_kwargs": {"enable_thinking": True}} if a.enable_thinking else {}
        rc = RunConfig(url, model, temperature=a.temperature, ignore_eos=a.ignore_eos,
                       request_rate=a.request_rate, max_concurrency=a.max_concurrency, seed=a.seed,
                       api_key=a.api_key, timeout=a.timeout, extra_body=extra)  # fmt: skip
        if a.warmup_requests:
            asyncio.run(self._warmup(rc))
        return rc

    def _record(self, config: str, rc: RunConfig, argv: list[str] | None, wl: W.Workload,
                results: list[RequestResult], duration: float) -> None:  # fmt: skip
        s = summarize(results, duration)
        sweep = sweep_rows(results, wl.sweep_n, self.divergence) if wl.sweep_n else None
        print(format_summary(f"{wl.name} [{config}] {wl.num_requests} requests", s, sweep), flush=True)
        print(flush=True)
        self.runs.append({"config": config, "url": rc.base_url, "server_args": argv, "workload": wl.name,
                          "params": wl.params, "focus_tag": wl.focus_tag, "summary": s, "sweep": sweep,
                          "results": results, "sweep_n": wl.sweep_n})  # fmt: skip

    def run_against(self, config: str, url: str, server_argv: list[str] | None) -> None:
        """Every workload against one server."""
        rc = self._connect(url)
        for wl in self.workloads or []:
            before = _encoder_runs(url, self.headers)
            results, duration = asyncio.run(run_workload(wl, rc))
            self._record(config, rc, server_argv, wl, results, duration)
            after = _encoder_runs(url, self.headers)
            if before is not None and after is not None:  # a server with an image encoder
                print(f"image encoder runs [{config}]: {after - before:.0f}", flush=True)
                self.runs[-1]["image_encoder_runs"] = after - before

    def run_interleaved(self, servers: list[tuple[str, str, list[str] | None]]) -> None:
        """Every workload against all servers at once, one session at a time, each session sent to every
        server in turn, so that load from elsewhere on the machine hits every configuration alike.
        Durations (for throughput) are each server's own busy time."""
        rcs = {name: self._connect(url) for name, url, _ in servers}
        argv = {name: a for name, _, a in servers}
        for wl in self.workloads or []:
            out = asyncio.run(run_interleaved(wl, rcs))
            for name, (results, busy) in out.items():
                self._record(name, rcs[name], argv[name], wl, results, busy)

    async def _warmup(self, rc: RunConfig) -> None:
        rng = random.Random(-1)
        async with httpx.AsyncClient(timeout=rc.timeout) as c:
            for i in range(self.args.warmup_requests):
                msgs = [{"role": "user", "content": f"Warmup {i}. " + W.random_text(rng, 64, 1.3)}]
                res = await chat_request(c, rc, msgs, 4, RequestResult("warmup", i, "warmup"))
                if not res.ok:
                    log.warning("warmup request failed: %s", res.error)

    def compare(self) -> list[dict]:
        out = []
        for wl in self.workloads or []:
            mine = [r for r in self.runs if r["workload"] == wl.name]
            if len(mine) < 2:
                continue
            text, data = comparison(
                wl.name,
                wl.focus_tag,
                {r["config"]: r["summary"] for r in mine},
                {r["config"]: r["results"] for r in mine},
                wl.sweep_n,
                self.divergence,
            )
            print(text, flush=True)
            print(flush=True)
            out.append({"workload": wl.name, **data})
        return out

    def dump(self, path: str, comparisons: list[dict]) -> None:
        a = vars(self.args).copy()
        a.pop("func", None)
        doc = {
            "args": {
                k: (v if not isinstance(v, float) or v != float("inf") else "inf") for k, v in a.items()
            },
            "tokens_per_word": self.tpw,
            "runs": [
                {
                    **{k: v for k, v in r.items() if k not in ("results", "sweep_n")},
                    "requests": [x.to_json() for x in r["results"]],
                }
                for r in self.runs
            ],
            "comparisons": comparisons,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {path}")
