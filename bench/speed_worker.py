"""swaserve side of `swaserve bench speed`: one engine in this process, the protocol of speed_peer.py.

  python -m swaserve.bench.speed_worker --gguf F --threads N [--cpu-matmul native|exact|fast] ...
Runs the synchronous engine (no HTTP): greedy, EOS ignored, every stream of a step in one batch.
"""

from __future__ import annotations

import argparse
import json
import time

from swaserve.bench.speed_peer import GAP_LEAD, ints, measure
from swaserve.bench.speed_peer import parse as parse_common


def longest_run(args: argparse.Namespace) -> int:
    """Tokens of the longest sequence the long runs hold: a --contexts prompt and its tokens, or the gap
    run's long prompt beside its short stream."""
    runs = [c + args.context_gen for c in ints(args.contexts)]
    if args.gap_context:
        runs.append(args.gap_context + 1 + args.prompt_len + GAP_LEAD)
    return max(runs, default=0)


def longest_request(args: argparse.Namespace) -> int:
    """Tokens of the longest single request of the long runs (the gap run's two requests apart: each must
    fit the engine's per-request context, their sum the KV pools)."""
    return max([c + args.context_gen for c in ints(args.contexts)] + [args.gap_context + 1])


def kv_gb_for(args: argparse.Namespace, n_seq: int, chunk: int) -> float:
    """--kv-gb, or more when the long runs need it: the longest run's full-attention tokens, and every
    stream's sliding window with two prefill chunks of SWA tokens (a quarter on top for page padding)."""
    longest = longest_run(args)
    if not longest:
        return args.kv_gb
    import torch

    from swaserve.engine.attention.kv_format import kv_format
    from swaserve.engine.attention.kv_pool import bytes_per_token
    from swaserve.models.gguf_loader import read_config

    cfg = read_config(args.gguf)
    fmt = kv_format(args.kv_dtype, torch.device("cpu"), cpu_matmul=args.cpu_matmul)
    full_b, swa_b = bytes_per_token(cfg, fmt)
    swa_tokens = (n_seq + 2) * (cfg.sliding_window + 64) + 2 * chunk
    return max(args.kv_gb, 1.25 * (longest * full_b + swa_tokens * swa_b) / 2**30)


class Swa:
    def __init__(self, args: argparse.Namespace, n_seq: int):
        from swaserve.engine.config import SchedulerConfig
        from swaserve.engine.core import SamplingParams
        from swaserve.llm import LLM

        self.params = SamplingParams
        chunk = max(512, args.prompt_len, n_seq * args.stream_prompt_len)  # a step prefills every stream
        if longest_run(args):  # long prompts are prefilled in chunks of the engine's default size, as served
            chunk = max(chunk, SchedulerConfig().chunked_prefill_size)
        self.kv_gb = kv_gb_for(args, n_seq, chunk)
        t0 = time.perf_counter()
        self.llm = LLM(args.gguf, progress=True, cpu_threads=args.threads, cpu_matmul=args.cpu_matmul,
                       max_running_requests=n_seq, chunked_prefill_size=chunk, device="cpu",
                       kv_cache_memory_gb=self.kv_gb, kv_cache_dtype=args.kv_dtype,
                       cpu_threads_follow_load=args.follow_load)
        self.load_s = time.perf_counter() - t0
        self.engine = self.llm.engine
        if self.engine.context_length < longest_request(args):
            raise SystemExit(f"the engine serves {self.engine.context_length} tokens a request, the long runs"
                             f" need {longest_request(args)}: raise --kv-gb")
        self.vocab = self.engine.model_config.vocab_size
        self._count = 0

    def _add(self, ids: list[int], gen: int) -> str:
        self._count += 1
        rid = f"speed-{self._count}"
        self.engine.add_request(rid, ids, self.params(max_tokens=gen, temperature=0.0, ignore_eos=True), ())
        return rid

    def run(self, prompts: list[list[int]], gen: int) -> list[float]:
        """Seconds since start after each step once every stream has its first token."""
        for ids in prompts:
            self._add(ids, gen)
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

    def gap(self, a: list[int], b: list[int]) -> tuple[list[float], float, float]:
        """Stream a decodes GAP_LEAD tokens alone, then prompt b is added and the engine's steps go on (b
        prefilled in chunks beside a's decode, as the server schedules them) until b has its first token
        and a a token at or after it. Wall seconds since start: after each of a's tokens, when b was
        added, when b had its first token."""
        room = self.engine.context_length - len(a)  # a must not finish while b prefills
        rid_a = self._add(a, min(room, GAP_LEAD + len(b) + 8))
        t0 = time.perf_counter()
        times: list[float] = []
        rid_b, b_added, b_first = None, 0.0, None
        while b_first is None or times[-1] < b_first:
            outs = self.engine.step()
            now = time.perf_counter() - t0
            for out in outs:
                if out.token_ids and out.request_id == rid_a:
                    times.append(now)
                elif out.token_ids and out.request_id == rid_b:
                    b_first = now
            if rid_b is None and len(times) == GAP_LEAD:
                rid_b, b_added = self._add(b, 1), now
        self.engine.abort(rid_a)
        while self.engine.has_unfinished():
            self.engine.step()
        return times, b_added, b_first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-matmul", default="native")
    p.add_argument("--follow-load", action="store_true",
                   help="the thread count follows the free cores, up to --threads")
    known, rest = p.parse_known_args()
    args = parse_common(rest)
    args.cpu_matmul, args.follow_load = known.cpu_matmul, known.follow_load
    engine = Swa(args, max([1, *ints(args.streams), 2 if args.gap_context else 1]))
    res = measure(engine, args)
    res["kv_pool_mb"] = engine.engine.pool.nbytes() / 2**20  # allocated at start (zeros: touched lazily)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
