"""`swaserve serve | fleet | generate | make-model | bench` (console script `swaserve =
swaserve.cli:main`)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swaserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    from swaserve.engine.args import add_engine_args

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    from swaserve.server.launch import add_serve_args

    add_serve_args(serve)

    fleet = sub.add_parser("fleet", allow_abbrev=False,
                           help="N serve replicas behind a prefix-affine router (smg; docs/scale-out.md)")
    add_engine_args(fleet)
    add_serve_args(fleet)
    from swaserve.server.fleet.launch import add_fleet_args

    add_fleet_args(fleet)

    gen = sub.add_parser("generate", help="generate a completion offline")
    add_engine_args(gen)
    from swaserve.llm import add_generate_args

    add_generate_args(gen)

    mk = sub.add_parser("make-model", help="write a random Gemma 4 GGUF (demo, tests, benchmarks)")
    from swaserve.models.demo.tiny import add_make_model_args

    add_make_model_args(mk)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from swaserve.bench.serve_bench import add_bench_args

    add_bench_args(bsub.add_parser("serve", help="serving benchmark over HTTP"))
    from swaserve.bench.speed import add_speed_args

    add_speed_args(bsub.add_parser("speed", help="CPU engine speed, beside llama.cpp with --peer"))
    from swaserve.bench import cache_sim

    cache_sim.add_cache_args(bsub.add_parser(
        "cache", help="prefix-cache reuse: workloads x SWA pool sizes x retention policies (no model)",
        description=cache_sim.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return p


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            from swaserve.server.launch import run_serve

            return run_serve(args)
        if args.command == "fleet":
            from swaserve.server.fleet.launch import run_fleet

            return run_fleet(args, raw[raw.index("fleet") + 1:])
        if args.command == "generate":
            from swaserve.llm import run_generate

            return run_generate(args)
        if args.command == "make-model":
            from swaserve.models.demo.tiny import run_make_model

            return run_make_model(args)
        if args.command == "bench" and args.bench_command == "speed":
            from swaserve.bench.speed import run_speed

            return run_speed(args)
        if args.command == "bench" and args.bench_command == "cache":
            from swaserve.bench.cache_sim import run_cache

            return run_cache(args)
        if args.command == "bench":
            from swaserve.bench.serve_bench import run_bench

            return run_bench(args)
    except ValueError as e:  # bad user input: one line, no traceback
        print(f"swaserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
