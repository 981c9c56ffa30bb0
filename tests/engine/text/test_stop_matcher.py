"""Stop strings against brute force (issue 14 item 3): the Aho-Corasick matcher and TextStream's cut.

Brute force: after each token, search the whole text so far for every stop string; at the first token
where any occurs, the occurrence starting first wins (on a tie, the shorter) and the text is cut there.
TextStream must emit exactly that text (held-back characters included), token by token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.text.text_stream import StopMatcher, TextStream


class PieceTokenizer:
    """Token i is the UTF-8 of pieces[i] (no special tokens)."""

    special_ids: frozenset[int] = frozenset()

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i].encode()


def brute_force(pieces: list[str], stops: list[str], include_stop: bool) -> tuple[str, str | None]:
    text = ""
    for p in pieces:
        text += p
        found = [(text.find(s), len(s), s) for s in stops if s and s in text]
        if found:
            start, _, s = min(found)
            return text[:start + (len(s) if include_stop else 0)], s
    return text, None


def streamed(pieces: list[str], stops: list[str], include_stop: bool) -> tuple[str, str | None]:
    ts = TextStream(PieceTokenizer(pieces), stops, skip_special_tokens=True, include_stop=include_stop)
    out = ""
    for i in range(len(pieces)):
        text, matched = ts.push(i)
        out += text
        if matched is not None:
            return out, matched
    text, matched = ts.finish()
    return out + text, matched


alphabet = st.sampled_from("abcé")  # é: two UTF-8 bytes, one character


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet, max_size=4), max_size=25),
       stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6),
       include_stop=st.booleans())
def test_text_stream_cuts_where_brute_force_does(pieces: list[str], stops: list[str],
                                                  include_stop: bool) -> None:
    assert streamed(pieces, stops, include_stop) == brute_force(pieces, stops, include_stop)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet, max_size=60),
       stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6))
def test_matcher_states_are_the_longest_suffixes(text: str, stops: list[str]) -> None:
    m, state = StopMatcher(stops), 0
    prefixes = {s[:k] for s in stops for k in range(len(s) + 1)}
    for i, ch in enumerate(text):
        state = m.step(state, ch)
        seen = text[:i + 1]
        assert m.depth[state] == max(k for k in range(len(seen) + 1) if seen[len(seen) - k:] in prefixes)
        ends = [s for s in stops if seen.endswith(s)]
        assert m.match[state] == (max(ends, key=len) if ends else None)


def test_work_per_token_does_not_grow_with_the_output_or_the_stop_count() -> None:
    """151 stop strings of 40 characters that the text keeps almost matching: the automaton steps (failure
    links included) per token over the last 2,000 of 20,000 tokens equal the first 2,000's (a rescan of the
    text per token would grow with it), and stay within 2 per character whatever the number of stop strings
    (a scan per stop string grows with their number). Counted, not timed."""
    stops = [f"{'ab' * 19}{chr(0x100 + i)}{i % 10}" for i in range(151)]
    pieces = ["ab"] * 20_000

    def steps(stop_list: list[str]) -> list[int]:
        ts = TextStream(PieceTokenizer(pieces), stop_list, skip_special_tokens=True)
        m, calls = ts.matcher, [0]
        plain = m.step

        def counted(state: int, ch: str) -> int:
            calls[0] += 1
            return plain(state, ch)

        m.step = counted  # step recurses through self.step: failure-link steps are counted too
        marks = []
        for i in range(len(pieces)):
            if i in (2_000, 18_000):
                marks.append(calls[0])
            assert ts.push(i)[1] is None
        return [marks[0], calls[0] - marks[1]]

    first, last = steps(stops)
    assert last <= first, (first, last)
    assert first <= 2 * 2 * 2_000, first  # 2 characters per token
    assert steps(stops[:1])[0] * 2 >= first  # one stop string or 151: the same order of work
