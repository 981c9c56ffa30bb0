"""swaserve side of `swaserve bench speed`: one engine in this process, the protocol of speed_peer.py.

  python -m swaserve.bench.speed_worker --gguf F --threads N [--cpu-matmul native|exact|fast] ...
Runs the synchronous engine (no HTTP): greedy, EOS ignored, every stream of a step in one batch.
"""

from __future__ import annotations

import argparse
import json
import time

from swaserve.bench.speed_peer import measure
from swaserve.bench.speed_peer import parse as parse_common


class Swa:
    def __init__(self, args: argparse.Namespace, n_seq: int):
        from swaserve.engine.core import SamplingParams
        from swaserve.llm import LLM

        self.params = SamplingParams
        chunk = max(512, args.prompt_len, n_seq * args.stream_prompt_len)  # a step prefills every stream
        t0 = time.perf_counter()
        self.llm = LLM(args.gguf, progress=True, cpu_threads=args.threads, cpu_matmul=args.cpu_matmul,
                       max_running_requests=n_seq, chunked_prefill_size=chunk, device="cpu",
                       kv_cache_memory_gb=args.kv_gb, kv_cache_dtype=args.kv_dtype,
                       cpu_threads_follow_load=args.follow_load)
        self.load_s = time.perf_counter() - t0
        self.engine = self.llm.engine
        self.vocab = self.engine.model_config.vocab_size
        self._count = 0

    def run(self, prompts: list[list[int]], gen: int) -> list[float]:
        """Seconds since start after each step once every stream has its first token."""
        sp = self.params(max_tokens=gen, temperature=0.0, ignore_eos=True)
        for ids in prompts:
            self._count += 1
            self.engine.add_request(f"speed-{self._count}", ids, sp, ())
        t0, c0 = time.perf_counter(), time.process_time()
        started: set[str] = set()
        times: list[float] = []
        self.cpu_times: list[float] = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.token_ids:
                    started.add(out.request_id)
            if len(started) == len(prompts):
                times.append(time.perf_counter() - t0)
                self.cpu_times.append(time.process_time() - c0)
        return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-matmul", default="native")
    p.add_argument("--follow-load", action="store_true",
                   help="the thread count follows the free cores, up to --threads")
    known, rest = p.parse_known_args()
    args = parse_common(rest)
    args.cpu_matmul, args.follow_load = known.cpu_matmul, known.follow_load
    streams = [int(s) for s in args.streams.split(",") if s]
    engine = Swa(args, max([1, *streams]))
    res = measure(engine, args)
    res["kv_pool_mb"] = engine.engine.pool.nbytes() / 2**20  # allocated at start (zeros: touched lazily)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
