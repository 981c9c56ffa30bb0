"""Stop strings: cost of many stop strings against none, measured side by side in one run.

    python -m tools.serving.stop_bench [--stops 151] [--tokens 2200] [--repeats 3]

Two tables. (1) Text processing alone (engine/text/text_stream.py) over the same token stream: no stop
strings, the automaton with N stop strings, and the earlier per-token rescan (kept here as the
reference it replaced). (2) End to end on the demo model (`tiny`, greedy, ignore_eos): one request
of --tokens tokens without stop strings and the same request with N stop strings that never match,
alternated --repeats times; the ratio is what issue 14 asks to keep within 1.2.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from swaserve.engine.core import SamplingParams
from swaserve.engine.text.text_stream import TextStream


class RescanTextStream(TextStream):
    """The matcher TextStream used before the automaton: every stop string searched in the held-back
    text plus the new text, and the held-back suffix found by trying every prefix of every stop string."""

    def _process(self, new: str, final: bool) -> tuple[str, str | None]:
        buf = self.held + new
        best = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.held = ""
            return buf[:best[0]], best[1]
        if final or not self.stop:
            self.held = ""
            return buf, None
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None


def make_stops(n: int, rng: random.Random) -> list[str]:
    """n stop strings of 20-80 characters that a random-weight model will not produce: each starts
    with a common character (so prefixes are held back often) and goes on with rare ones."""
    rare = "\u00a7\u00b6\u2020\u2021"
    return [" " + "".join(rng.choice(rare) for _ in range(rng.randint(19, 79))) for _ in range(n)]


def time_text(cls: type[TextStream], tokenizer, stops: Sequence[str], ids: Sequence[int]) -> float:
    ts = cls(tokenizer, stops, skip_special_tokens=True)
    t0 = time.perf_counter()
    for t in ids:
        ts.push(t)
    ts.finish()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stops", type=int, default=151)
    ap.add_argument("--tokens", type=int, default=2200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from swaserve.llm import LLM

    rng = random.Random(0)
    stops = make_stops(args.stops, rng)
    llm = LLM(None, context_length=4096)
    prompt = llm.encode("The stop-string benchmark prompt.")
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with_stops = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, stop=tuple(stops))
    ids = llm.generate(prompt, plain)[0].token_ids  # the token stream both text tables replay

    print(f"text processing of {len(ids)} tokens, best of {args.repeats}")
    base = min(time_text(TextStream, llm.tokenizer, [], ids) for _ in range(args.repeats))
    print(f"{'matcher':<28}{'seconds':>10}{'us/token':>10}{'vs none':>9}")
    for name, cls, s in (("no stop strings", TextStream, []),
                         (f"automaton, {len(stops)} stops", TextStream, stops),
                         (f"rescan, {len(stops)} stops", RescanTextStream, stops)):
        t = min(time_text(cls, llm.tokenizer, s, ids) for _ in range(args.repeats))
        print(f"{name:<28}{t:>10.4f}{1e6 * t / len(ids):>10.1f}{t / base:>9.2f}")

    walls: dict[str, list[float]] = {"plain": [], "stops": []}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("stops", with_stops)):
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            walls[name].append(time.perf_counter() - t0)
            assert len(out.token_ids) == args.tokens, (name, len(out.token_ids), out.finish_reason)
    p, s = statistics.median(walls["plain"]), statistics.median(walls["stops"])
    print(f"\nend to end, tiny model, {args.tokens} tokens, median of {args.repeats}")
    print(f"{'request':<28}{'seconds':>10}{'ratio':>9}")
    print(f"{'no stop strings':<28}{p:>10.2f}{1.0:>9.2f}")
    print(f"{f'{len(stops)} stop strings':<28}{s:>10.2f}{s / p:>9.2f}")


if __name__ == "__main__":
    main()
