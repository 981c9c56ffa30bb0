"""Engine throughput on CPU (no HTTP): prefill tokens/s, decode tokens/s at several concurrencies,
scheduler + cache time as a share of step time, and resident memory over a steady load.

    swaserve make-model --preset small --out /tmp/small.gguf
    python -m tools.serving.engine_throughput --model /tmp/small.gguf [--json out.json]

Without --model the `small` preset is generated once into $SWASERVE_CACHE (or ~/.cache/swaserve).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import typing
from pathlib import Path

import psutil

from swaserve.engine.config import CpuMatmul
from swaserve.engine.core import SamplingParams


def _small_model() -> str:
    from swaserve.models.demo.tiny import make_model

    cache = Path(os.environ.get("SWASERVE_CACHE") or Path.home() / ".cache" / "swaserve")
    path = cache / "swaserve-bench-small.gguf"
    if not path.exists():
        make_model("small", str(path), seed=0, progress=True)
    return str(path)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [2] + [rng.randrange(3, vocab) for _ in range(n - 1)]


class Runner:
    def __init__(self, engine):
        self.engine = engine
        self.requests_added = 0

    def add(self, ids: list[int], max_tokens: int) -> str:
        self.requests_added += 1
        rid = f"b{self.requests_added}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, ids, params)
        return rid

    def prefilling(self) -> bool:
        s = self.engine.scheduler
        return bool(s.waiting) or any(r.num_computed < len(r.token_ids) - 1 for r in s.running)


def bench_prefill(r: Runner, rng: random.Random, vocab: int, length: int) -> dict:
    eng = r.engine
    r.add(_ids(rng, length, vocab), 1)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    return {"tokens": length, "seconds": dt, "tokens_per_s": length / dt}


def bench_decode(r: Runner, rng: random.Random, vocab: int, conc: int, prompt_len: int, tokens: int) -> dict:
    eng = r.engine
    for _ in range(conc):
        r.add(_ids(rng, prompt_len, vocab), tokens)
    while r.prefilling():
        eng.step()
    s0, st0, g0, n0 = eng.sched_time, eng.step_time, eng.generation_tokens_total, eng.steps
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    gen = eng.generation_tokens_total - g0
    steps = eng.steps - n0
    return {
        "concurrency": conc,
        "tokens": gen,
        "steps": steps,
        "seconds": dt,
        "tokens_per_s": gen / dt,
        "ms_per_step": 1000 * dt / steps,
        "sched_share": (eng.sched_time - s0) / (eng.step_time - st0),
    }


def bench_steady(r: Runner, rng: random.Random, vocab: int, conc: int, steps: int, first: int,
                 prompt: tuple[int, int], output: tuple[int, int]) -> dict:
    """Keep `conc` requests running (random prompt / output lengths in the given ranges, a new one
    whenever one finishes); RSS at step `first` and at step `steps`."""
    eng = r.engine
    proc = psutil.Process()
    live: set[str] = set()
    rss: dict[int, int] = {}
    s0 = st0 = 0.0
    for step in range(1, steps + 1):
        live = {x for x in live if x in eng._open}
        while len(live) < conc:
            live.add(r.add(_ids(rng, rng.randint(*prompt), vocab), rng.randint(*output)))
        eng.step()
        if step == first:
            rss[first] = proc.memory_info().rss
            s0, st0 = eng.sched_time, eng.step_time
    rss[steps] = proc.memory_info().rss
    for x in live:
        eng.abort(x)
    while eng.has_unfinished():
        eng.step()
    return {
        "concurrency": conc,
        "steps": steps,
        "rss_first_mb": rss[first] / 2**20,
        "rss_last_mb": rss[steps] / 2**20,
        "rss_change": rss[steps] / rss[first] - 1,
        "sched_share": (eng.sched_time - s0) / (eng.step_time - st0),
        "preemptions": eng.scheduler.num_preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the small preset, generated once)")
    p.add_argument("--concurrency", default="1,8,32", help="decode concurrencies (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per decode request")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode request")
    p.add_argument("--prefill-len", type=int, default=2048, help="tokens of the prefill measurement")
    p.add_argument("--steady-steps", type=int, default=2000, help="steps of the steady load (0 = skip)")
    p.add_argument("--steady-first", type=int, default=100, help="step of the first RSS sample")
    p.add_argument("--steady-prompt", default="16,96", help="prompt length range of the steady load")
    p.add_argument("--steady-output", default="64,256", help="output length range of the steady load")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--q4",
        choices=list(typing.get_args(CpuMatmul)),
        default="exact",
        help="CPU Q4_0 path of fp32 activations (the engine's --cpu-matmul): exact (default) or fast "
        "(bf16 int4)",
    )
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)

    import torch

    from swaserve.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or _small_model()
    conc = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(
        model,
        progress=True,
        max_running_requests=max(args.max_running_requests, max(conc)),
        chunked_prefill_size=args.chunked_prefill_size,
        device="cpu",
        cpu_matmul=args.q4,
    )
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    r = Runner(eng)
    print(
        f"model {Path(model).name}, torch threads {torch.get_num_threads()}, Q4_0 path {args.q4}, "
        f"RSS after load {psutil.Process().memory_info().rss / 2**20:.0f} MiB"
    )
    t = time.perf_counter()  # warm-up: builds the per-weight caches, touches every expert
    bench_prefill(r, rng, vocab, 512)
    bench_decode(r, rng, vocab, max(conc), 16, 4)
    print(f"warm-up {time.perf_counter() - t:.1f}s")

    res: dict = {"model": Path(model).name, "threads": torch.get_num_threads(), "q4": args.q4}
    res["prefill"] = bench_prefill(r, rng, vocab, args.prefill_len)
    print(
        f"prefill: {args.prefill_len} tokens in {res['prefill']['seconds']:.2f}s = "
        f"{res['prefill']['tokens_per_s']:.0f} tokens/s"
    )
    res["decode"] = []
    print(f"{'concurrency':>11} {'tokens/s':>9} {'ms/step':>8} {'sched+cache':>12} {'vs c=1':>7}")
    for c in conc:
        d = bench_decode(r, rng, vocab, c, args.prompt_len, args.decode_tokens)
        res["decode"].append(d)
        base = res["decode"][0]["tokens_per_s"]
        print(
            f"{c:>11} {d['tokens_per_s']:>9.1f} {d['ms_per_step']:>8.1f} {100 * d['sched_share']:>11.2f}% "
            f"{d['tokens_per_s'] / base:>6.2f}x"
        )
    if args.steady_steps > args.steady_first:
        pr = tuple(int(x) for x in args.steady_prompt.split(","))
        out = tuple(int(x) for x in args.steady_output.split(","))
        s = bench_steady(r, rng, vocab, max(conc), args.steady_steps, args.steady_first, pr, out)  # type: ignore[arg-type]
        res["steady"] = s
        print(
            f"steady load, {s['concurrency']} running: RSS {s['rss_first_mb']:.0f} MiB at step "
            f"{args.steady_first} -> {s['rss_last_mb']:.0f} MiB at step {s['steps']} "
            f"({100 * s['rss_change']:+.2f}%), sched+cache {100 * s['sched_share']:.2f}% of step time, "
            f"{s['preemptions']} preemptions"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
