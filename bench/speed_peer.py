"""llama.cpp side of `swaserve bench speed`: run as a script by the Python that has llama-cpp-python.

Standalone on purpose (stdlib, numpy and llama_cpp only, no swaserve import): the peer may live in
another virtual environment. Same protocol and JSON line as bench/speed_worker.py (see bench/speed.py):
  python speed_peer.py --gguf F --threads N --prompt-len P --gen G --streams 8,32 --stream-prompt-len Q
    --stream-gen S --reps R [--contexts 4096,32768 --context-gen 16] [--gap-context C]
    [--flash-attn on|off] [--n-batch 512]
One llama_context (unified KV, n_seq_max = the largest stream count) decodes every stream of a step in
one llama_decode, as llama-server does with --parallel; greedy argmax on the logits of each stream.
The gap run (--gap-context) does what llama-server's continuous batching does: each llama_decode carries
the decoding stream's next token and up to n_batch - 1 tokens of the long prompt (llama-server fills its
batch of --batch-size tokens, 2048 by default, decode tokens first; llama_decode splits it into ubatches).
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


GAP_LEAD = 6  # tokens the short stream decodes alone before the long prompt arrives


def ints(csv: str) -> list[int]:
    """'8,32' -> [8, 32] ('' -> [])."""
    return [int(s) for s in csv.split(",") if s.strip()]


def set_flash_attn(cp, on: bool) -> None:
    """Flash attention on or off in llama_context_params `cp`: llama-cpp-python 0.3.x has the int enum
    flash_attn_type (-1 auto, 0 disabled, 1 enabled), older versions the bool flash_attn."""
    if hasattr(cp, "flash_attn_type"):
        cp.flash_attn_type = 1 if on else 0
    elif hasattr(cp, "flash_attn"):
        cp.flash_attn = on
    else:
        raise SystemExit("llama_context_params has neither flash_attn_type nor flash_attn")


class Peer:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int, flash_attn: bool = True,
                 n_batch: int = 512):
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
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, min(n_batch, 512), n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        set_flash_attn(cp, flash_attn)
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.load_s = time.perf_counter() - t0
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, n_seq)

    def _submit(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most n_batch per llama_decode."""
        b = self.batch
        for i0 in range(0, len(items), self.n_batch):
            part = items[i0:i0 + self.n_batch]
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

    def gap(self, a: list[int], b: list[int]) -> tuple[list[float], float, float]:
        """Stream a decodes GAP_LEAD tokens alone, then prompt b (sequence 1) arrives and each llama_decode
        carries a's next token and the next n_batch - 1 tokens of b. Wall seconds since start: after each
        of a's tokens, when b arrived, when b had its first token."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        self._submit([(t, p, 0, p == len(a) - 1) for p, t in enumerate(a)])
        last, pos = self._argmax(-1), len(a)
        times = [time.perf_counter() - t0]
        while len(times) < GAP_LEAD:
            self._submit([(last, pos, 0, True)])
            last, pos = self._argmax(0), pos + 1
            times.append(time.perf_counter() - t0)
        b_added, done = times[-1], 0
        while done < len(b):
            part = b[done:done + self.n_batch - 1]
            self._submit([(last, pos, 0, True)]
                         + [(t, done + j, 1, done + j == len(b) - 1) for j, t in enumerate(part)])
            last, pos, done = self._argmax(0), pos + 1, done + len(part)
            times.append(time.perf_counter() - t0)
        return times, b_added, times[-1]


def gap_stats(a_times: list[float], b_added: float, b_first: float) -> dict:
    """The short stream's inter-token gaps (wall ms) while the long prompt is prefilled: from its last token
    before the prompt arrived to its first token at or after the prompt's first token; beside them its
    plain decode step before, and the long prompt's TTFT."""
    before = [t for t in a_times if t <= b_added]
    during = before[-1:] + [t for t in a_times if t > b_added]
    end = next(i for i, t in enumerate(during) if t >= b_first)
    plain = sorted(1e3 * (y - x) for x, y in zip(before, before[1:]))
    gaps = [1e3 * (y - x) for x, y in zip(during, during[1:end + 1])]
    return {"a_step_ms": plain[len(plain) // 2] if plain else None, "gap_max_ms": max(gaps),
            "gap_median_ms": sorted(gaps)[len(gaps) // 2], "gaps_ms": gaps, "b_ttft_s": b_first - b_added}


def measure(engine, args: argparse.Namespace) -> dict:
    """The protocol shared with bench/speed_worker.py. Each engine's run(prompts, gen) returns the wall
    seconds since start after each step once every stream has its first token, and leaves the process
    CPU seconds at the same points in engine.cpu_times (the `*_cpu` values: robust on a busy machine).
    Then one 1-stream run per --contexts value (`*_at_C`), and with --gap-context the engine's
    gap(short prompt, long prompt) run (gap_stats)."""
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
    for b in ints(args.streams):
        prompts = [prompt_ids(100 + b + i, args.stream_prompt_len, vocab) for i in range(b)]
        times = engine.run(prompts, args.stream_gen)
        cpu = engine.cpu_times
        res[f"decode_tps_{b}"] = b * (len(times) - 1) / (times[-1] - times[0])
        res[f"decode_tps_{b}_cpu"] = b * (len(cpu) - 1) / max(cpu[-1] - cpu[0], 1e-9)
    for c in ints(args.contexts):  # one long prompt, then --context-gen tokens decoded at that depth
        times = engine.run([prompt_ids(1000 + c, c, vocab)], args.context_gen)
        cpu = engine.cpu_times
        res[f"prefill_tps_at_{c}"], res[f"prefill_tps_at_{c}_cpu"] = c / times[0], c / max(cpu[0], 1e-9)
        res[f"decode_tps_at_{c}"] = (len(times) - 1) / (times[-1] - times[0])
        res[f"decode_tps_at_{c}_cpu"] = (len(cpu) - 1) / max(cpu[-1] - cpu[0], 1e-9)
    if args.gap_context:
        got = engine.gap(prompt_ids(90, args.prompt_len, vocab), prompt_ids(91, args.gap_context, vocab))
        res["gap"] = {"context": args.gap_context, **gap_stats(*got)}
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
    p.add_argument("--contexts", default="")  # long-prompt lengths (already clamped by bench/speed.py)
    p.add_argument("--context-gen", type=int, default=16)
    p.add_argument("--gap-context", type=int, default=0)
    p.add_argument("--flash-attn", choices=("on", "off"), default="on")  # llama.cpp only
    p.add_argument("--n-batch", type=int, default=512)  # llama.cpp only: n_batch (n_ubatch = min(it, 512))
    return p.parse_args(argv)


def peer_n_ctx(args: argparse.Namespace) -> int:
    """The unified KV's tokens: the largest run of the protocol (every stream of a step together; the gap
    run's short stream beside its long prompt), plus a margin."""
    n_seq = max([1, *ints(args.streams)])
    runs = [args.prompt_len + args.gen, n_seq * (args.stream_prompt_len + args.stream_gen)]
    runs += [c + args.context_gen for c in ints(args.contexts)]
    if args.gap_context:  # the short stream decodes one token per batch of the long prompt
        a_tokens = GAP_LEAD + args.gap_context // (args.n_batch - 1) + 2
        runs.append(args.gap_context + args.prompt_len + a_tokens)
    return max(runs) + 64


def main() -> None:
    args = parse()
    n_seq = max([1, *ints(args.streams), 2 if args.gap_context else 1])
    peer = Peer(args.gguf, args.threads, peer_n_ctx(args), n_seq, args.flash_attn == "on", args.n_batch)
    print("RESULT " + json.dumps(measure(peer, args)), flush=True)


if __name__ == "__main__":
    main()
