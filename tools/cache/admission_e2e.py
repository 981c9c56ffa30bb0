"""Cache-aware admission end to end: round-robin fan-out through the real engine (LLM API, the demo model on
CPU, step costs measured by the engine), `--admission-policy fcfs` against `cache-aware`, side by side in
one run. Prints the cached prompt tokens, the wall time and the costs the engine measured.

    python -m swaserve.tools.cache.admission_e2e [--groups 12] [--system 400] [--rounds 6] [--in-flight 4]
    python -m swaserve.tools.cache.admission_e2e --gguf small.gguf --system 2048 --groups 8 --rounds 3 \
        --max-total-tokens 16384 --chunk 512

The KV arena is kept small (--max-total-tokens, default 2400), so the groups' system prompts do not all fit.
"""

from __future__ import annotations

import argparse
import random
import time

from swaserve.engine.core import SamplingParams
from swaserve.llm import LLM


def run(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[int, float, float, float]:
    in_flight = args.in_flight
    llm = LLM(args.gguf, admission_policy=policy, max_running_requests=in_flight,
              chunked_prefill_size=args.chunk, max_total_tokens=args.max_total_tokens, device="cpu",
              progress=False, cpu_threads=args.threads)
    try:
        t0 = time.perf_counter()
        cached = 0
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for k in range(0, len(prompts), in_flight):  # in_flight requests at a time, round-robin over groups
            cached += sum(o.cached_tokens for o in llm.generate(prompts[k:k + in_flight], params))
        costs = llm.engine.scheduler.admission.costs
        return cached, time.perf_counter() - t0, costs.step_s or 0.0, costs.token_s or 0.0
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=12, help="distinct system prompts (default 12)")
    p.add_argument("--system", type=int, default=400, help="system prompt tokens (default 400)")
    p.add_argument("--rounds", type=int, default=6, help="requests per group (default 6)")
    p.add_argument("--in-flight", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--gguf", default=None, help="a GGUF (default: the demo model)")
    p.add_argument("--max-total-tokens", type=int, default=2400, help="the engine's KV size (default 2400)")
    p.add_argument("--chunk", type=int, default=128, help="--chunked-prefill-size (default 128)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    args = p.parse_args(argv)
    rng = random.Random(0)
    systems = [[2] + [rng.randrange(300, 3000) for _ in range(args.system - 1)] for _ in range(args.groups)]
    prompts = [systems[g] + [rng.randrange(300, 3000) for _ in range(8)]
               for _ in range(args.rounds) for g in range(args.groups)]
    total = sum(len(x) for x in prompts)
    rows = [(policy, *run(policy, prompts, args)) for policy in ("fcfs", "cache-aware")]
    print(f"| policy | cached tokens (of {total}) | wall s | measured step ms | measured ms / prompt token |")
    print("|---|---|---|---|---|")
    for policy, cached, secs, step_s, token_s in rows:
        print(f"| {policy} | {cached} | {secs:.2f} | {1e3 * step_s:.2f} | {1e3 * token_s:.3f} |")
    ratio = rows[1][1] / max(1, rows[0][1])
    print(f"cache-aware / fcfs: cached {ratio:.2f}x, wall {rows[1][2] / rows[0][2]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
