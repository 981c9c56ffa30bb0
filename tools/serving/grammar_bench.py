"""Per-token cost of structured output in the batched sampler, on a 262,144-token vocabulary.

    python -m tools.serving.grammar_bench [--steps 40] [--reps 3] [--threads 1]

For B = 1 and B = 32 it times one sampler step (engine/runner/sampling.py `sample`, the Gemma 4 defaults
temperature 1, top_k 64, top_p 0.95) over random fp32 logits [B, 262144]:
  * plain: no row constrained (the baseline);
  * all: every row constrained (a JSON schema, or Gemma tool calls), including the matcher update
    (`GrammarState.sync`), the mask fill (`GrammarBackend.fill`) and its application in `sample`;
  * 1 of 32: one row constrained, 31 free.
Matchers are driven along valid token sequences (so every step is a real mask). Every step times the
plain sampler step, then the grammar's own work for that step: the fill (matcher update + bitmask) and
the apply (`apply_token_bitmask` on the constrained rows, which is what `sample` adds); per step the
best of --reps runs is kept, and the table gives medians over the steps and their sum as a share of
the sampler step. (The difference of two whole sampler steps is below the noise of a shared machine.)

The vocabulary: the demo tokenizer's 3,072 tokens (Gemma 4's control tokens at Gemma's ids, the 256
byte tokens) plus 259,072 synthetic pieces (words in several scripts, with and without a leading
space, digits, punctuation runs with quotes and brackets), so the token trie has the size and rough
shape of Gemma 4's. Encoding is greedy longest-match (only used to drive the matchers).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from swaserve.engine.core import GrammarSpec, SamplingParams
from swaserve.engine.runner.sampling import SampleRow, apply_token_bitmask, make_generator, sample
from swaserve.engine.text.grammar import GrammarBackend
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata

VOCAB = 262144
SHIP = {"type": "object", "additionalProperties": False, "required": ["city", "express"],
        "properties": {"city": {"type": "string"}, "express": {"type": "boolean"}}}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["id", "name", "price", "tags", "ship"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "price": {"type": "number"},
                         "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}}, "ship": SHIP,
                         "note": {"type": ["string", "null"]}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


class BenchVocab:
    """What GrammarBackend reads from a tokenizer, for a synthetic 262k vocabulary."""

    def __init__(self, size: int = VOCAB, seed: int = 0):
        meta = demo_tokenizer_metadata()
        pieces = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        types = list(meta["tokenizer.ggml.token_type"])
        self.special_ids = {i for i, t in enumerate(types) if t in (2, 3, 5)}
        self.bos_id = 2
        self._bytes: list[bytes] = []
        for p, ty in zip(pieces, types):
            if ty == 6:
                self._bytes.append(bytes([int(p[3:5], 16)]))
            else:
                self._bytes.append(p.replace("\u2581", " ").encode())
        seen = set(self._bytes)
        rng = random.Random(seed)
        alphabets = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghij", "0123456789",
                     "абвгдежзийклмнопрстуфхцчшщыэюя", "的一是不了人我在有他这中大来上国个到说",
                     "가나다라마바사아자차카타파하", "éèêàçôûïü", '{}[]":,.;!?()<>-_=+*/\\\'|#@$%&']
        while len(self._bytes) < size:
            alpha = rng.choice(alphabets)
            piece = "".join(rng.choice(alpha) for _ in range(rng.randint(1, 9)))
            if rng.random() < 0.45:
                piece = " " + piece
            b = piece.encode()
            if b not in seen:
                seen.add(b)
                self._bytes.append(b)
        self.vocab_size = len(self._bytes)
        self._by_text = {b: i for i, b in enumerate(self._bytes) if i not in self.special_ids}
        self._specials = {self._bytes[i].decode(): i for i in self.special_ids}

    def token_bytes(self, i: int) -> bytes:
        return self._bytes[i]

    def encode(self, text: str) -> list[int]:
        """Greedy longest match; control tokens written in the text are matched whole."""
        out: list[int] = []
        data = text.encode()
        i = 0
        while i < len(data):
            for name, tid in self._specials.items():
                if data.startswith(name.encode(), i):
                    out.append(tid)
                    i += len(name.encode())
                    break
            else:
                for n in range(min(24, len(data) - i), 0, -1):
                    tid = self._by_text.get(data[i:i + n])
                    if tid is not None:
                        out.append(tid)
                        i += n
                        break
                else:  # a byte token
                    out.append(self._by_text[data[i:i + 1]])
                    i += 1
        return out


def _json_doc(rng: random.Random) -> str:
    words = ["alpha", "Oslo", "de la Tour", "naïve", "über", "x" * 7, "北京", "ok"]
    doc = {"id": rng.randint(1, 10**6), "name": " ".join(rng.choice(words) for _ in range(rng.randint(2, 6))),
           "price": round(rng.uniform(0, 1000), 2),
           "tags": rng.sample(["new", "sale", "eco"], rng.randint(0, 3)),
           "ship": {"city": rng.choice(words), "express": rng.random() < 0.5},
           "note": rng.choice([None, "fragile"])}
    return json.dumps(doc, ensure_ascii=False)


def _call_doc(rng: random.Random) -> str:
    q = '<|"|>'
    city = rng.choice(["Oslo", "Paris, FR", "São Paulo", "New York"])
    return f"<|tool_call>call:get_weather{{city:{q}{city}{q},days:{rng.randint(1, 14)}," \
           f"unit:{q}celsius{q}}}<tool_call|>"


def _time(fn: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(backend: GrammarBackend, spec: GrammarSpec, seqs: list[list[int]], params: SamplingParams,
             batch: int, constrained: int, steps: int, reps: int) -> tuple[float, float, float]:
    """(plain step, grammar fill, mask apply) in seconds: medians over steps of the best of `reps`.

    Each step times the plain sampler, then the grammar's work for the same step: fill = matcher update +
    bitmask fill, apply = `apply_token_bitmask` on the constrained rows (what `sample` adds)."""
    logits = torch.randn(batch, backend.vocab_size, generator=torch.Generator().manual_seed(0))
    plain = [float("inf")] * steps
    fill = [float("inf")] * steps
    apply = [float("inf")] * steps
    for _ in range(reps):
        states = [backend.new_state(spec) for _ in range(constrained)]
        rows = [SampleRow(params, make_generator(r)) for r in range(batch)]
        grammar_rows = list(range(constrained))
        for t in range(steps):
            t0 = time.perf_counter()
            sample(logits, rows)
            t1 = time.perf_counter()
            for j, st in enumerate(states):
                st.sync(seqs[j][:t])
            mask = backend.fill(states)
            t2 = time.perf_counter()
            x = logits.clone()
            t3 = time.perf_counter()
            apply_token_bitmask(x, grammar_rows, mask)
            t4 = time.perf_counter()
            plain[t] = min(plain[t], t1 - t0)
            fill[t] = min(fill[t], t2 - t1)
            apply[t] = min(apply[t], t4 - t3)
    return statistics.median(plain), statistics.median(fill), statistics.median(apply)


def run(steps: int, reps: int, report: Any = None) -> list[tuple[str, int, str, float, float, float, int]]:
    vocab = BenchVocab()
    backend = GrammarBackend(vocab, [1, 6])
    from swaserve.server.chat.tool_grammar import tool_calls_lark

    specs = {"json schema": (GrammarSpec("json_schema", json.dumps(SCHEMA)), _json_doc),
             "Gemma tool call": (GrammarSpec("lark", tool_calls_lark([TOOL], parallel=False, thinking=False)),
                                 _call_doc)}
    params = SamplingParams(temperature=1.0, top_k=64, top_p=0.95)
    rows_out = []
    for name, (spec, make_doc) in specs.items():
        backend.check(spec)
        rng = random.Random(1)
        seqs = []
        while len(seqs) < 32:
            ids = vocab.encode(make_doc(rng))
            if len(ids) >= steps:
                seqs.append(ids[:steps])
        for batch, constrained in ((1, 1), (32, 32), (32, 1)):
            plain, fill, apply = _measure(backend, spec, seqs, params, batch, constrained, steps, reps)
            label = f"{constrained} of {batch}" if batch > 1 else "1"
            rows_out.append((name, batch, label, plain * 1e6, fill * 1e6, apply * 1e6, constrained))
            if report is not None:
                report(rows_out[-1])
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="sampler steps per run (tokens per sequence)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocabulary {VOCAB}, {args.steps} steps, best of {args.reps}, torch threads {args.threads}",
          flush=True)
    print("| grammar | batch | constrained rows | sampler step µs | fill µs | apply µs | overhead / step "
          "| overhead per constrained row µs |")
    print("|---|---|---|---|---|---|---|---|")

    def report(row: tuple[str, int, str, float, float, float, int]) -> None:
        name, batch, label, plain, fill, apply, n = row
        over = fill + apply
        print(f"| {name} | {batch} | {label} | {plain:,.0f} | {fill:,.0f} | {apply:,.0f} "
              f"| {over / plain:.1%} | {over / n:,.0f} |", flush=True)

    run(args.steps, args.reps, report)


if __name__ == "__main__":
    main()
