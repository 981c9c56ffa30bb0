"""Per-choice output text: incremental detokenization plus stop strings that may span tokens.

Stop strings are matched by an Aho-Corasick automaton over all of a request's stop strings, fed only
the new characters of each token: the cost per token is O(new characters), whatever the number of stop
strings and the length of the output so far (a rescan of held-back text per stop string cost about
quadratically in the stop strings' lengths per token; docs/serving.md, "Limits").

Semantics: of the stop strings found in the text decided so far, the one starting first wins (on a
tie, the shorter); the text from its start on is cut (kept with include_stop). Text that could still
be the start of a stop string is held back until decided.
"""

from __future__ import annotations

from collections.abc import Sequence

from swaserve.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer


class StopMatcher:
    """Aho-Corasick automaton over a set of stop strings (character level).

    State = a trie node = the longest suffix of the text seen so far that is a prefix of some stop
    string; `depth[state]` is its length, `match[state]` the longest stop string that is a suffix of
    it (None if none). Transitions are resolved through failure links once and memoised per state.
    """

    def __init__(self, stops: Sequence[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match: list[str | None] = [None]
        for s in stops:
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(None)
                node = nxt
            self.match[node] = s
        self.fail = [0] * len(self.goto)
        self.hops = 0  # failure links followed by step() (tests count the work)
        self.delta: list[dict[str, int]] = [dict(g) for g in self.goto]  # memoised full transitions
        order = list(self.goto[0].values())  # breadth first: a node's fail link is shallower
        for node in order:
            for ch, child in self.goto[node].items():
                order.append(child)
                f = self.fail[node] if node else 0
                target = self.step(f, ch) if node else 0
                self.fail[child] = target if target != child else 0
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]

    def step(self, state: int, ch: str) -> int:
        """The state after reading `ch` in `state`: a loop down the failure links (no recursion: a stop
        string of 1,000 repeated characters makes a chain 1,000 links deep), memoised for every state
        walked through (they all lead to the same state on `ch`)."""
        nxt = self.delta[state].get(ch)
        if nxt is not None:
            return nxt
        walked = [state]
        s = state
        while True:
            if s == 0:
                nxt = 0
                break
            s = self.fail[s]
            self.hops += 1
            nxt = self.delta[s].get(ch)
            if nxt is not None:
                break
            walked.append(s)
        for w in walked:
            if len(self.delta[w]) < 256:  # bound the memo per state (arbitrary text, many characters)
                self.delta[w][ch] = nxt
        return nxt


class TextStream:
    """Per-choice text: incremental detokenization plus stop strings that may span tokens (see the
    module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], skip_special_tokens: bool,
                 mark_special_tokens: bool = False, include_stop: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                                            mark_special_tokens=mark_special_tokens)
        self.stop = [s for s in stop if s]
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self.state = 0
        self.include_stop = include_stop  # the matched stop string stays at the end of the text
        self.held = ""  # the last depth[state] characters: possibly the start of a stop string

    def _process(self, new: str, final: bool) -> tuple[str, str | None]:
        m = self.matcher
        if m is None:
            return new, None
        state = self.state
        best: tuple[int, str] | None = None  # (start in held + new, stop string): the earliest start
        for i, ch in enumerate(new):
            state = m.step(state, ch)
            matched = m.match[state]
            if matched is not None:  # a stop string ends at new[i]; the longest one starts first
                start = len(self.held) + i + 1 - len(matched)
                if best is None or start < best[0]:
                    best = (start, matched)
            elif best is not None and len(self.held) + i + 1 - m.depth[state] > best[0]:
                break  # no later match can start before the best one
        if best is not None:
            buf = self.held + new
            self.held, self.state = "", 0
            return buf[:best[0] + (len(best[1]) if self.include_stop else 0)], best[1]
        self.state = state
        buf = self.held + new
        keep = 0 if final else m.depth[state]
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def push(self, token_id: int) -> tuple[str, str | None]:
        """(text to emit, matched stop string or None)."""
        return self._process(self.detok.push(token_id), final=False)

    def finish(self) -> tuple[str, str | None]:
        return self._process(self.detok.flush(), final=True)
