"""Stop strings against brute force (issue 14 item 3; long ones, issue 24 item 1): the Aho-Corasick
matcher and TextStream's cut.

Brute force: after each token, search the whole text so far for every stop string; at the first token
where any occurs, the occurrence starting first wins (on a tie, the shorter) and the text is cut there.
TextStream must emit exactly that text (held-back characters included), token by token."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.core import MAX_STOP_CHARS, MAX_STOP_LENGTH, RequestError, SamplingParams
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


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet, max_size=4), max_size=25),
       stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6))
def test_text_stream_holds_only_a_possible_stop_prefix(pieces: list[str], stops: list[str]) -> None:
    """Until a stop string matches, the text out after each token is the text so far but for its longest
    suffix that could still begin a stop string (docs/serving.md, "Streaming")."""
    ts = TextStream(PieceTokenizer(pieces), stops, skip_special_tokens=True)
    out = seen = ""
    for i, p in enumerate(pieces):
        text, matched = ts.push(i)
        if matched is not None:
            return
        out, seen = out + text, seen + p
        held = max(k for k in range(len(seen) + 1) if any(s.startswith(seen[len(seen) - k:]) for s in stops))
        assert out == seen[:len(seen) - held]


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

        m.step = counted  # one call per character; m.hops counts the failure links followed
        marks = []
        for i in range(len(pieces)):
            if i in (2_000, 18_000):
                marks.append(calls[0] + m.hops)
            assert ts.push(i)[1] is None
        return [marks[0], calls[0] + m.hops - marks[1]]

    first, last = steps(stops)
    assert last <= first, (first, last)
    assert first <= 2 * 2 * 2_000, first  # 2 characters per token
    assert steps(stops[:1])[0] * 2 >= first  # one stop string or 151: the same order of work


# Long stop strings: a run of one character ("a" * 1000 + "Z") makes a failure-link chain as deep as the
# run; the matcher walks it in a loop (it used to recurse, and overflowed the stack at about 1,000).
@contextmanager
def shallow_stack(frames: int = 100) -> Iterator[None]:
    """Allow only `frames` more Python frames than are in use here (Hypothesis raises the recursion limit
    while it runs a test; the engine process runs at Python's default of 1,000)."""
    depth, f = 0, sys._getframe()
    while f is not None:
        depth, f = depth + 1, f.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


@st.composite
def long_stops(draw: st.DrawFn) -> list[str]:
    """1-4 stop strings, each a few runs of one character (up to the per-string limit in all) with short
    tails: the text below keeps almost matching them."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        lengths = st.one_of(st.integers(1, 64), st.integers(900, MAX_STOP_LENGTH))  # short, or deep chains
        runs = draw(st.lists(st.tuples(st.sampled_from("ab"), lengths), min_size=1, max_size=3))
        s = "".join(ch * n for ch, n in runs)[:MAX_STOP_LENGTH - 3] + draw(st.text("abZ", max_size=3))
        out.append(s)
    return out


def long_pieces(data: st.DataObject, stops: list[str]) -> list[str]:
    """Text made of prefixes of the stop strings (almost matches: deep states) and a few other characters,
    cut into tokens at random points."""
    parts = []
    for _ in range(data.draw(st.integers(0, 5))):
        s = data.draw(st.sampled_from(stops))
        parts += [s[:data.draw(st.integers(0, len(s)))], data.draw(st.text("abZ", max_size=3))]
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=30)))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=60, deadline=None)
@given(stops=long_stops(), include_stop=st.booleans(), data=st.data())
def test_long_stop_strings_cut_where_brute_force_does(stops: list[str], include_stop: bool,
                                                       data: st.DataObject) -> None:
    pieces = long_pieces(data, stops)
    with shallow_stack():
        got = streamed(pieces, stops, include_stop)
    assert got == brute_force(pieces, stops, include_stop)


def test_a_thousand_repeats_do_not_recurse() -> None:
    """The issue's stop string, under a recursion limit far below its depth: no RecursionError, the
    matcher holds back the run, then cuts at the match (and releases the run when "b" breaks it)."""
    stop = "a" * 1000 + "Z"
    with shallow_stack():
        first = streamed(["a" * 999, "a", "b", "a" * 1000, "Z", "tail"], [stop], False)
        second = streamed(["a" * 1500, "Z"], [stop], True)
    assert first == ("a" * 1000 + "b", stop)
    assert second == ("a" * 1500 + "Z", stop)


def test_total_stop_characters_are_bounded() -> None:
    ok = SamplingParams(stop=("a" * 1000 + "Z", "b" * 1024, "c" * 1024, "d" * 1023))
    ok.validate(100)  # 4,096 characters in all: the limit
    try:
        SamplingParams(stop=("a" * 1024,) * 4 + ("x",)).validate(100)
    except RequestError as e:
        assert e.param == "stop" and str(MAX_STOP_CHARS) in str(e)
    else:
        raise AssertionError("4,097 stop characters were accepted")
