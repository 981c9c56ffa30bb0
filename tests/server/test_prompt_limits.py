"""server/prompt_limits.py: the character bound is safe (no text of the demo vocabulary's pieces makes
fewer tokens than characters / max_token_chars), refuses exactly past context x max_token_chars, and gives
no bound where the tokenizer could fuse unknown characters into one token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.server.errors import APIError
from swaserve.server.prompt_limits import check_chars, check_tokens, max_token_chars, message_chars

TOK = Tokenizer.from_metadata(demo_tokenizer_metadata())
PIECES = [TOK.id_to_piece(i).replace("▁", " ") for i in range(TOK.vocab_size) if TOK.token_type(i) != 6]


def test_the_longest_piece_is_the_bound() -> None:
    assert max_token_chars(TOK) == max(len(p) for p in PIECES) == 16


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(sorted(PIECES, key=len)[-300:]) | st.text(max_size=5), max_size=60))
def test_no_text_makes_fewer_tokens_than_the_bound(parts: list[str]) -> None:
    text = "".join(parts)  # long pieces back to back: the fewest tokens per character
    per = max_token_chars(TOK)
    assert per is not None and len(TOK.encode(text)) * per >= len(text)


def test_check_chars_refuses_exactly_past_the_bound() -> None:
    check_chars(100 * 16, 100, TOK, "prompt")  # may fit: 100 tokens of 16 characters
    with pytest.raises(APIError) as e:
        check_chars(100 * 16 + 1, 100, TOK, "prompt")
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "context_length_exceeded")
    assert "at least 101 tokens (1601 characters, at most 16 per token)" in e.value.message
    check_chars(10**9, None, TOK, "prompt")  # no context known: no check
    with pytest.raises(APIError, match="the prompt has 100 tokens, which does not leave room"):
        check_tokens(100, 100, "messages")
    check_tokens(99, 100, "messages")


class _Vocab:
    """A tokenizer double: pieces and types, an <unk> and only `byte_tokens` byte tokens."""

    def __init__(self, byte_tokens: int, unk: bool):
        self.pieces = ["<unk>", "abc", *[f"<0x{b:02X}>" for b in range(byte_tokens)]]
        self.unk_id = 0 if unk else None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i]

    def token_type(self, i: int) -> int:
        return 6 if self.pieces[i].startswith("<0x") else 2 if i == 0 else 1


def test_no_bound_where_unknown_characters_fuse_into_one_token() -> None:
    assert max_token_chars(_Vocab(256, True)) == 5  # "<unk>" itself
    assert max_token_chars(_Vocab(255, False)) == 5
    assert max_token_chars(_Vocab(255, True)) is None  # a missing byte: one fused <unk> of any length
    check_chars(10**9, 10, _Vocab(255, True), "prompt")
    assert max_token_chars(object()) is None


def test_message_chars_counts_what_a_template_renders() -> None:
    msgs = [{"role": "system", "content": "  sys  "}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "x" * 1000}, {"role": "tool", "content": "42"},
            {"role": "user", "content": None}]
    assert message_chars(msgs) == 3 + 5 + 2
