"""Serving benchmark (`swaserve bench serve`): fan-out, append, divergence sweep and random workloads
over the OpenAI HTTP API, against a running server (--url) or servers it starts, one per configuration
(--compare: lazy, eager with a 16-token budget as the seed engine, naive)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import sys

from swaserve.bench.serve_compare import DEFAULT_CONFIGS, ServerProcess, parse_config
from swaserve.bench.serve_runner import BenchRunner

WORKLOADS = ("fanout", "fanout-image", "append", "sweep", "random")


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
        "--interleave",
        action="store_true",
        help="start all servers at once and send each session to every one in turn (one request at a "
        "time), so load from elsewhere on the machine affects every configuration alike; implies --compare",
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
        "--model-preset", default=None, help="make (once, cached) and serve a models/demo/tiny.py preset"
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
    w.add_argument("--image-size", type=int, default=224,
                   help="fanout-image: side of each group's shared random PNG (default 224)")
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
    o.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG charts into DIR: TTFT by configuration, the divergence sweep, cached "
                        "share over time (needs matplotlib: pip install 'swaserve[plot]')")
    o.add_argument("--log-level", default="warning")


def _preset_path(preset: str) -> str:
    """A random model of a models/demo/tiny.py preset, made once into $SWASERVE_CACHE (or
    ~/.cache/swaserve)."""
    from swaserve.models.demo import tiny

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
    if args.interleave and (
        args.url or args.max_concurrency not in (None, 1) or args.request_rate != float("inf")
    ):
        raise ValueError(
            "--interleave starts its servers and sends one request at a time (no --url, "
            "--max-concurrency or --request-rate)"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.tokens_per_word is not None and args.tokens_per_word <= 0:
        raise ValueError(f"--tokens-per-word must be positive, got {args.tokens_per_word}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if getattr(args, "plot", None):
        from swaserve.bench.serve_plot import check_matplotlib

        check_matplotlib()
        if os.path.exists(args.plot) and not os.path.isdir(args.plot):
            raise ValueError(f"--plot {args.plot}: exists and is not a directory")
    return names


def _plots(args: argparse.Namespace, bench: BenchRunner) -> None:
    if args.plot:
        from swaserve.bench.serve_plot import write_plots

        for path in write_plots(bench.runs, bench.divergence, args.plot):
            print(f"wrote {path}", flush=True)


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `swaserve bench serve`; ValueError for bad flags (cli.py prints one line)."""
    names = _validate(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    bench = BenchRunner(args, names)
    if args.url:
        bench.run_against("server", args.url.rstrip("/"), None)
        if args.json:
            bench.dump(args.json, [])
        _plots(args, bench)
        return 0 if all(r["summary"]["failed"] == 0 for r in bench.runs) else 1
    if (args.compare or args.interleave) and args.temperature != 0:
        raise ValueError("--compare checks outputs under greedy decoding: use --temperature 0")
    configs = (
        [parse_config(c) for c in args.config]
        if args.config
        else (DEFAULT_CONFIGS if args.compare or args.interleave else DEFAULT_CONFIGS[:1])
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
    if args.interleave:
        try:
            with contextlib.ExitStack() as stack:
                start = [
                    ServerProcess(n, base + f, args.server_timeout, args.server_log_dir) for n, f in configs
                ]
                srvs = [stack.enter_context(srv) for srv in start]
                bench.run_interleaved([(s.name, s.url, s.argv) for s in srvs])
        except RuntimeError as e:
            print(f"swaserve bench: {e}", file=sys.stderr)
            rc = 1
    for name, flags in [] if args.interleave else configs:
        try:
            with ServerProcess(name, base + flags, args.server_timeout, args.server_log_dir) as srv:
                bench.run_against(name, srv.url, srv.argv)
        except RuntimeError as e:  # a server that does not start: report it, go on with the others
            print(f"swaserve bench: {e}", file=sys.stderr)
            rc = 1
    comps = bench.compare()
    if args.json:
        bench.dump(args.json, comps)
    _plots(args, bench)
    if any(r["summary"]["failed"] for r in bench.runs):
        rc = 1
    return rc
