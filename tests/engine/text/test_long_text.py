"""engine/text/long_text.py: a text encoded a piece at a time (cut where newline runs start or end) gives
exactly the ids of one encode, for any text (special tokens, multi-byte characters, newline runs, lone
surrogates); stop_after ends early with at least that many ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.text.long_text import encode_long, pieces, splits_at_newlines
from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(demo_tokenizer_metadata())


_words = st.sampled_from(["the", " ", "  ", "\n", "\n\n", "\n\n\n", "weather", "é", "日本", "🙂", "<|turn>",
                          "<turn|>", "<|tool_response>", "<eos>", "\t", "responsibility", "x", "\ud800"])
_texts = st.lists(_words, max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_texts, size=st.integers(1, 12), add_bos=st.booleans())
def test_pieces_encode_to_the_ids_of_the_whole_text(tok: Tokenizer, text: str, size: int,
                                                    add_bos: bool) -> None:
    assert splits_at_newlines(tok)
    parts = list(pieces(text, size))
    assert "".join(parts) == text
    for a, b in zip(parts, parts[1:]):  # each cut where a newline run starts or ends
        assert (a[-1] == "\n") != (b[0] == "\n"), (a, b)
    ids, cut = encode_long(tok, text, add_bos, size=size)
    assert not cut
    assert ids.tolist() == tok.encode(text, add_bos=add_bos)


def test_a_long_text_is_cut_and_stops_after_enough_ids(tok: Tokenizer) -> None:
    text = "one line of the weather report\n\n" * 20000
    assert len(list(pieces(text))) > 2
    ids, cut = encode_long(tok, text)
    assert not cut and ids.tolist() == tok.encode(text)
    part, cut = encode_long(tok, text, stop_after=5000)
    assert cut and 5000 <= len(part) < len(ids)
    assert part.tolist() == ids.tolist()[:len(part)]


def test_a_tokenizer_that_cannot_be_cut_encodes_in_one_call() -> None:
    class Plain:
        bos_id = 2

        def encode(self, text: str) -> list[int]:
            return [len(text)]

    ids, cut = encode_long(Plain(), "a\nb" * 300000, add_bos=True)
    assert ids.tolist() == [2, 900000] and not cut
