"""Serving benchmark (`swaserve bench serve`): fan-out, append, divergence sweep and random workloads
over the OpenAI HTTP API, against a running server (--url) or servers it starts, one per configuration
(--compare: lazy, eager with a 16-token budget as the seed engine, naive)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shlex
import sys

import httpx

from bench import workloads as W
from bench.serve_client import RunConfig, chat_request, count_tokens, model_id, run_workload, tokenize_chat
from bench.serve_compare import DEFAULT_CONFIGS, ServerProcess, comparison, parse_config
from bench.serve_stats import RequestResult, format_summary, summarize, sweep_rows

log = logging.getLogger(__name__)

WORKLOADS = ("fanout", "append", "sweep", "random")
DEFAULT_TOKENS_PER_WORD = 1.3


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate must be a number or inf, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be positive, got {v}")
    return v


def add_bench_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default=None, help="drive a running server (e.g. http://127.0.0.1:8000)")
    t.add_argument(
        "--compare",
        action="store_true",
        help="start one server per configuration (default: lazy, eager16, naive) and compare",
    )
    t.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="NAME=FLAGS",
        help="a server configuration to start (repeatable), e.g. 'eager64=--swa-retain-policy eager "
        "--swa-retain-budget 64'",
    )
    t.add_argument("--model", default=None, help="GGUF for the servers this command starts")
    t.add_argument(
        "--model-preset", default=None, help="make (once, cached) and serve a models/tiny.py preset"
    )
    t.add_argument("--server-args", default="", help="extra `swaserve serve` flags for every started server")
    t.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    t.add_argument("--server-log-dir", default=None, help="keep the started servers' logs here")
    t.add_argument(
        "--served-model-name", default=None, help="model name in requests (default: GET /v1/models)"
    )
    t.add_argument("--api-key", default=None)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        default="fanout",
        help=f"comma-separated, run in order: {', '.join(WORKLOADS)} (default fanout)",
    )
    w.add_argument("--num-groups", type=int, default=4, help="fanout: groups (distinct system prompts)")
    w.add_argument("--prompts-per-group", type=int, default=4, help="fanout: prompts per group")
    w.add_argument("--system-prompt-len", type=int, default=2048, help="fanout/append: system prompt tokens")
    w.add_argument("--question-len", type=int, default=128, help="fanout/append: user message tokens")
    w.add_argument("--output-len", type=int, default=32, help="fanout/append: max_tokens")
    w.add_argument("--num-sessions", type=int, default=2, help="append: conversations")
    w.add_argument("--num-turns", type=int, default=4, help="append: user turns per conversation")
    w.add_argument(
        "--sweep-n",
        type=_int_list,
        default=[3, 4, 5, 6, 7, 8, 12, 16, 64, 256],
        help="sweep: N values (identical tokens after the differing one)",
    )
    w.add_argument("--sweep-prefix-len", type=int, default=1900, help="sweep: shared prefix tokens")
    w.add_argument("--sweep-output-len", type=int, default=16, help="sweep: max_tokens")
    w.add_argument("--num-prompts", type=int, default=16, help="random: prompts")
    w.add_argument("--random-input-len", type=int, default=512)
    w.add_argument("--random-output-len", type=int, default=64)
    w.add_argument("--random-range-ratio", type=float, default=1.0)
    w.add_argument(
        "--tokens-per-word",
        type=float,
        default=None,
        help="skip calibration with /tokenize and use this ratio",
    )
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=_rate, default=float("inf"), help="Poisson arrivals per second")
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ld.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="short unrelated requests sent first, not measured (lazy init, weight repacking)",
    )
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (forced with --compare)")
    ld.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let generation stop at EOS (default: ignore_eos, fixed output lengths)",
    )
    ld.add_argument(
        "--enable-thinking", action="store_true", help="send chat_template_kwargs.enable_thinking=true"
    )
    ld.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE", help="write summaries and per-request records")
    o.add_argument("--log-level", default="warning")


def _preset_path(preset: str) -> str:
    """A random model of a models/tiny.py preset, made once into $SWASERVE_CACHE (or ~/.cache/swaserve)."""
    from models import tiny

    if preset not in tiny.PRESETS:
        raise ValueError(f"--model-preset {preset!r}: choose from {', '.join(tiny.PRESETS)}")
    if preset == "tiny":
        return tiny.demo_model_path()
    d = os.environ.get("SWASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swaserve")
    tag = getattr(tiny, "_demo_fingerprint", lambda: "v0")()  # a changed generator gives a new file
    path = os.path.join(d, f"swaserve-bench-{preset}-{tag}.gguf")
    if not os.path.isfile(path):
        print(f"making the {preset!r} preset model: {path}", file=sys.stderr, flush=True)
        tiny.make_model(preset, path, seed=0, progress=True)
    return path


def _validate(args: argparse.Namespace) -> list[str]:
    names = [x.strip() for x in args.workload.split(",") if x.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise ValueError(f"--workload {n!r}: choose from {', '.join(WORKLOADS)}")
    if not names:
        raise ValueError("--workload is empty")
    if args.url and (args.compare or args.config):
        raise ValueError("--url drives one running server; --compare/--config start their own")
    if args.url and (args.model or args.model_preset or args.server_args):
        raise ValueError("--model/--model-preset/--server-args only apply to servers this command starts")
    if args.model and args.model_preset:
        raise ValueError("give --model or --model-preset, not both")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.tokens_per_word is not None and args.tokens_per_word <= 0:
        raise ValueError(f"--tokens-per-word must be positive, got {args.tokens_per_word}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    return names


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
        if n == "fanout":
            out.append(
                W.fanout(
                    args.num_groups,
                    args.prompts_per_group,
                    args.system_prompt_len,
                    args.question_len,
                    args.output_len,
                    tpw,
                    args.seed,
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


class _Bench:
    """Runs every workload against one server at a time and collects the records."""

    def __init__(self, args: argparse.Namespace, names: list[str]):
        self.args, self.names = args, names
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.workloads: list[W.Workload] | None = None
        self.runs: list[dict] = []
        self.tpw: tuple[float, float] | None = None
        self.divergence: dict[int, int] = {}  # sweep N -> tokens before the 1st prompt's end (from /tokenize)

    def run_against(self, config: str, url: str, server_argv: list[str] | None) -> None:
        a = self.args
        model = a.served_model_name or asyncio.run(_model_name(url, self.headers))
        if self.workloads is None:  # built once, from the first server, so every configuration gets the same
            if a.tokens_per_word is not None:
                self.tpw = (a.tokens_per_word, a.tokens_per_word)
            else:
                self.tpw = asyncio.run(_calibrate(url, model, self.headers, a.seed))
                if self.tpw is None:
                    log.warning(
                        "POST /tokenize unavailable: assuming %.2f tokens per word", DEFAULT_TOKENS_PER_WORD
                    )
                    self.tpw = (DEFAULT_TOKENS_PER_WORD, DEFAULT_TOKENS_PER_WORD)
            self.workloads = build_workloads(a, self.names, *self.tpw)
            for wl in self.workloads:
                if wl.sweep_n:
                    self.divergence = asyncio.run(_divergence(url, model, self.headers, wl))
        extra = {"chat_template_kwargs": {"enable_thinking": True}} if a.enable_thinking else {}
        rc = RunConfig(
            url,
            model,
            temperature=a.temperature,
            ignore_eos=a.ignore_eos,
            request_rate=a.request_rate,
            max_concurrency=a.max_concurrency,
            seed=a.seed,
            api_key=a.api_key,
            timeout=a.timeout,
            extra_body=extra,
        )
        if a.warmup_requests:
            asyncio.run(self._warmup(rc))
        for wl in self.workloads:
            results, duration = asyncio.run(run_workload(wl, rc))
            s = summarize(results, duration)
            sweep = sweep_rows(results, wl.sweep_n, self.divergence) if wl.sweep_n else None
            print(format_summary(f"{wl.name} [{config}] {wl.num_requests} requests", s, sweep), flush=True)
            print(flush=True)
            self.runs.append(
                {
                    "config": config,
                    "url": url,
                    "server_args": server_argv,
                    "workload": wl.name,
                    "params": wl.params,
                    "focus_tag": wl.focus_tag,
                    "summary": s,
                    "sweep": sweep,
                    "results": results,
                    "sweep_n": wl.sweep_n,
                }
            )

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


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `swaserve bench serve`; ValueError for bad flags (cli.py prints one line)."""
    names = _validate(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    bench = _Bench(args, names)
    if args.url:
        bench.run_against("server", args.url.rstrip("/"), None)
        if args.json:
            bench.dump(args.json, [])
        return 0 if all(r["summary"]["failed"] == 0 for r in bench.runs) else 1
    if args.compare and args.temperature != 0:
        raise ValueError("--compare checks outputs under greedy decoding: use --temperature 0")
    configs = (
        [parse_config(c) for c in args.config]
        if args.config
        else (DEFAULT_CONFIGS if args.compare else DEFAULT_CONFIGS[:1])
    )
    if len({c[0] for c in configs}) != len(configs):
        raise ValueError("--config names must be distinct")
    base = shlex.split(args.server_args)
    if args.model_preset:
        base = ["--model", _preset_path(args.model_preset), *base]
    elif args.model:
        if not os.path.isfile(args.model):
            raise ValueError(f"--model {args.model}: no such file")
        base = ["--model", args.model, *base]
    rc = 0
    for name, flags in configs:
        try:
            with ServerProcess(name, base + flags, args.server_timeout, args.server_log_dir) as srv:
                bench.run_against(name, srv.url, srv.argv)
        except RuntimeError as e:  # a server that does not start: report it, go on with the others
            print(f"swaserve bench: {e}", file=sys.stderr)
            rc = 1
    comps = bench.compare()
    if args.json:
        bench.dump(args.json, comps)
    if any(r["summary"]["failed"] for r in bench.runs):
        rc = 1
    return rc
