"""A long text's token ids, encoded a piece at a time into a compact array.

tokenizers keeps ~120 bytes per character of a text while it encodes it (normalized-string alignments,
each token's string and offsets), so a 7.8 MB prompt encoded in one call takes about a gigabyte. The
Gemma 4 tokenizer (engine/text/tokenizer.py) pre-splits text into runs of newlines and runs of anything
else, and BPE never merges across those runs; its whole-matched special tokens hold no newline. So
cutting the text where a newline run starts or ends gives exactly the ids of the whole text, and only one
piece (PIECE_CHARS, or one longer line) is in the tokenizer at a time. The ids go into an `array('i')`
(4 bytes each, not a Python list's ~36), and with `stop_after` encoding ends as soon as there are that
many (a prompt past the context length needs no more)."""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator
from typing import Any

from swaserve.engine.text import tokenizer as _tokenizer

PIECE_CHARS = 256 * 1024
_NEWLINES = re.compile(r"\n+")
_CONTROL, _UNKNOWN, _USER_DEFINED = 3, 2, 4  # GGUF token types matched whole before BPE


def splits_at_newlines(tok: Any) -> bool:
    """Whether cutting at newline runs keeps `tok`'s ids: the newline pre-split, no special token with a
    newline in it."""
    if not isinstance(tok, _tokenizer.Tokenizer) or _tokenizer.SPLIT_REGEX != r"[^\n]+|[\n]+":
        return False
    cached = getattr(tok, "_splits_at_newlines", None)
    if cached is None:
        whole = (_CONTROL, _UNKNOWN, _USER_DEFINED)
        cached = not any("\n" in tok.id_to_piece(i) for i in range(tok.vocab_size)
                         if tok.token_type(i) in whole)
        tok._splits_at_newlines = cached  # type: ignore[attr-defined]
    return cached


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` cut into pieces of about `size` characters, each cut where a newline run starts or ends."""
    start, n = 0, len(text)
    while n - start > size:
        i = text.find("\n", start + size)
        if i < 0:
            break
        if text[i - 1] == "\n":  # inside a newline run: cut where it ends
            i = _NEWLINES.match(text, i).end()  # type: ignore[union-attr]
            if i >= n:
                break
        yield text[start:i]
        start = i
    yield text[start:]


def encode_long(tok: Any, text: str, add_bos: bool = False, stop_after: int | None = None,
                size: int = PIECE_CHARS) -> tuple[array, bool]:
    """(ids of `text` as array('i'), cut): cut is True when encoding stopped at `stop_after` ids (the
    array then holds at least that many, not all). A tokenizer that cannot be cut at newlines encodes the
    text in one call."""
    ids = array("i", [tok.bos_id] if add_bos else [])
    parts = pieces(text, size) if splits_at_newlines(tok) else iter((text,))
    for part in parts:
        ids.extend(tok.encode(part))
        if stop_after is not None and len(ids) >= stop_after:
            return ids, True
    return ids, False
