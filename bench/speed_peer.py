"""llama.cpp side of `swaserve bench speed`: run as a script by the Python that has llama-cpp-python.

Standalone on purpose (stdlib, numpy and llama_cpp only, no swaserve import): the peer may live in
another virtual environment. Same protocol and JSON line as bench/speed_worker.py (see bench/speed.py):
  python speed_peer.py --gguf F --threads N --prompt-len P --gen G --streams 8,32 --stream-prompt-len Q
    --stream-gen S --reps R
One llama_context (unified KV, n_seq_max = the largest stream count) decodes every stream of a step in
one llama_decode, as llama-server does with --parallel; greedy argmax on the logits of each stream.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import time


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    """`n` pseudo-random ids (the BOS id 2 first) in [300, min(vocab, 3000)): same ids for every engine."""
    r = random.Random(seed)
    lo, hi = (300, min(vocab, 3000) - 1) if vocab > 1000 else (10, vocab - 1)
    return [2] + [r.randint(lo, hi) for _ in range(n - 1)]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Peer:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int):
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)  # kept alive: llama.cpp holds it
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        lc.llama_backend_init()
        t0 = time.perf_counter()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.load_s = time.perf_counter() - t0
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(512, 0, n_seq)

    def _submit(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most 512 per call."""
        b = self.batch
        for i0 in range(0, len(items), 512):
            part = items[i0:i0 + 512]
            b.n_tokens = len(part)
            for j, (t, p, s, want) in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, p, 1, want
                b.seq_id[j][0] = s
            rc = self.lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise SystemExit(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        floats = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        row = self.np.ctypeslib.as_array(floats, shape=(self.vocab,))
        return int(row.argmax())

    def run(self, prompts: list[list[int]], gen: int) -> list[float]:
        """Greedy-decode `gen` tokens for every prompt together; seconds since start after each step (wall;
        the process CPU seconds go to self.cpu_times)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0, c0 = time.perf_counter(), time.process_time()
        last = []
        for s, ids in enumerate(prompts):  # prefill, one sequence after the other (as the server does)
            self._submit([(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)])
            last.append(self._argmax(-1))
        times = [time.perf_counter() - t0]
        self.cpu_times = [time.process_time() - c0]
        pos = [len(p) for p in prompts]
        for _ in range(gen - 1):
            self._submit([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = [self._argmax(s) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
            times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)
        return times


def measure(engine, args: argparse.Namespace) -> dict:
    """The protocol shared with bench/speed_worker.py. Each engine's run(prompts, gen) returns the wall
    seconds since start after each step once every stream has its first token, and leaves the process
    CPU seconds at the same points in engine.cpu_times (the `*_cpu` values: robust on a busy machine)."""
    res: dict = {"load_s": engine.load_s}
    vocab = engine.vocab
    times = engine.run([prompt_ids(1, args.prompt_len, vocab)], args.gen)
    res["ttft_first_s"], res["ttft_first_cpu_s"] = times[0], engine.cpu_times[0]
    pre, dec, pre_cpu, dec_cpu = [], [], [], []
    for rep in range(args.reps):
        times = engine.run([prompt_ids(2 + rep, args.prompt_len, vocab)], args.gen)
        cpu = engine.cpu_times
        pre.append(times[0])
        pre_cpu.append(cpu[0])
        dec.append((len(times) - 1) / (times[-1] - times[0]))
        dec_cpu.append((len(cpu) - 1) / max(cpu[-1] - cpu[0], 1e-9))
    res["ttft_warm_s"], res["ttft_warm_cpu_s"] = min(pre), min(pre_cpu)
    res["prefill_tps"], res["prefill_tps_cpu"] = args.prompt_len / min(pre), args.prompt_len / min(pre_cpu)
    res["decode_tps_1"], res["decode_tps_1_cpu"] = max(dec), max(dec_cpu)
    for b in [int(s) for s in args.streams.split(",") if s]:
        prompts = [prompt_ids(100 + b + i, args.stream_prompt_len, vocab) for i in range(b)]
        times = engine.run(prompts, args.stream_gen)
        cpu = engine.cpu_times
        res[f"decode_tps_{b}"] = b * (len(times) - 1) / (times[-1] - times[0])
        res[f"decode_tps_{b}_cpu"] = b * (len(cpu) - 1) / max(cpu[-1] - cpu[0], 1e-9)
    res["rss_mb"] = rss_mb()
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen", type=int, required=True)
    p.add_argument("--streams", default="")
    p.add_argument("--stream-prompt-len", type=int, required=True)
    p.add_argument("--stream-gen", type=int, required=True)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--kv-gb", type=float, default=4.0)  # swaserve's KV pools (llama.cpp sizes its own)
    p.add_argument("--kv-dtype", default="auto")  # swaserve's KV dtype (llama.cpp: f16)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    streams = [int(s) for s in args.streams.split(",") if s]
    n_seq = max([1, *streams])
    n_ctx = max(args.prompt_len + args.gen, n_seq * (args.stream_prompt_len + args.stream_gen)) + 64
    print("RESULT " + json.dumps(measure(Peer(args.gguf, args.threads, n_ctx, n_seq), args)), flush=True)


if __name__ == "__main__":
    main()
