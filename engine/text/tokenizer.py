"""Gemma 4 tokenizer built from GGUF `tokenizer.*` metadata, and an incremental detokenizer.

Encoding runs on a `tokenizers` (Rust) BPE built from the GGUF vocab and merges: spaces become `▁`
(no prefix space), text is pre-split on `[^\\n]+|[\\n]+`, characters missing from the vocab fall back
to `<0xXX>` byte tokens, and control / user-defined tokens are matched whole before BPE.
Decoding maps ids to bytes in Python (`▁` -> space, byte tokens -> their byte).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Tokenizer", "IncrementalDetokenizer", "MARK_OPEN", "MARK_CLOSE"]

log = logging.getLogger(__name__)

# GGUF token types (gguf.constants.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPLIT_REGEX = r"[^\n]+|[\n]+"
_SURROGATE = re.compile("[\ud800-\udfff]")
LONG_TEXT_CHARS = 8192  # from here on, encode without holding the GIL (see _encode_one)
_K = "tokenizer.ggml."
# Marked decoding (IncrementalDetokenizer(mark_special_tokens=True)): a special token decodes to
# MARK_OPEN + its text + MARK_CLOSE and a MARK_OPEN character written as text to MARK_OPEN + MARK_CLOSE,
# so a reader tells the token `<eos>` from the text "<eos>" (private-use characters).
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"


def _byte_value(piece: str) -> int | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Sentencepiece-style BPE (no merges list): a piece is made from any two pieces, best score first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                found.append((-scores[pid], pid, lid, rid, left, right))
    found.sort()
    return [(f[4], f[5]) for f in found]


class Tokenizer:
    """Gemma 4 BPE tokenizer; build it with `Tokenizer.from_metadata(gguf_metadata)`."""

    def __init__(
        self,
        tokens: list[str],
        types: list[int],
        merges: list[tuple[str, str]],
        bos_id: int,
        eos_ids: set[int],
        add_bos_token: bool = True,
        unk_id: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        assert len(tokens) == len(types)
        self._tokens = tokens
        self._types = types
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids)
        self.add_bos_token = add_bos_token
        self.unk_id = unk_id
        self.pad_id = pad_id
        self._piece_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self._piece_to_id.setdefault(t, i)
        # ids skipped by decode(skip_special_tokens=True): control, unknown and unused tokens
        self.special_ids: set[int] = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN, UNUSED)}
        self._pieces: list[bytes] = []
        for t, ty in zip(tokens, types):
            b = _byte_value(t) if ty == BYTE else None
            self._pieces.append(bytes([b]) if b is not None else t.replace("▁", " ").encode("utf-8"))

        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
        model = models.BPE(
            vocab=dict(self._piece_to_id), merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
        )
        tok = HFTokenizer(model)
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated")
        whole: list[AddedToken] = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if self._piece_to_id[t] != i or not t:
                continue
            if ty in (CONTROL, UNKNOWN):
                whole.append(AddedToken(t, special=True, normalized=False))
            elif ty == USER_DEFINED:
                whole.append(AddedToken(t, special=False, normalized="▁" in t))
        tok.add_special_tokens(whole)
        self._hf = tok

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*`); model must be gemma4 (or llama + pre gemma4)."""
        model = meta.get(_K + "model")
        pre = meta.get(_K + "pre")
        if not (model == "gemma4" or (model == "llama" and pre == "gemma4")):
            raise ValueError(
                f"unsupported tokenizer: {_K}model={model!r} ({_K}pre={pre!r}); expected 'gemma4', "
                f"or 'llama' with {_K}pre='gemma4'"
            )
        tokens = meta.get(_K + "tokens")
        if not tokens:
            raise ValueError(f"missing or empty tokenizer key {_K}tokens")
        tokens = [str(t) for t in tokens]
        n = len(tokens)
        types = list(meta.get(_K + "token_type") or [NORMAL] * n)
        if len(types) != n:
            raise ValueError(f"{_K}token_type has {len(types)} entries, {_K}tokens has {n}")
        raw_merges = meta.get(_K + "merges")
        if raw_merges:
            merges = []
            for m in raw_merges:
                k = m.find(" ", 1)
                if k < 0:
                    raise ValueError(f"bad entry in {_K}merges: {m!r}")
                merges.append((m[:k], m[k + 1 :]))
        else:
            scores = meta.get(_K + "scores")
            if not scores or len(scores) != n:
                raise ValueError(f"{_K}merges is missing and {_K}scores is missing or of the wrong length")
            merges = _merges_from_scores(tokens, [float(s) for s in scores], types)

        def tid(key: str, default: int | None) -> int | None:
            v = meta.get(_K + key, default)
            if v is None:
                return None
            if not 0 <= int(v) < n:
                raise ValueError(f"{_K}{key}={v} is outside the vocabulary (size {n})")
            return int(v)

        bos = tid("bos_token_id", 2)
        eos = tid("eos_token_id", 1)
        assert bos is not None and eos is not None
        eos_ids = {eos}
        for v in meta.get(_K + "eos_token_ids") or []:
            if 0 <= int(v) < n:
                eos_ids.add(int(v))
        for name in ("<turn|>", "<|tool_response>"):
            if name in tokens:
                eos_ids.add(tokens.index(name))
        return cls(
            tokens, types, merges, bos_id=bos, eos_ids=eos_ids,
            add_bos_token=bool(meta.get(_K + "add_bos_token", True)),
            unk_id=tid("unknown_token_id", None), pad_id=tid("padding_token_id", None),
        )

    # -- vocabulary ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_id]

    @property
    def eos_token(self) -> str:
        return self._tokens[min(self.eos_ids)] if self.eos_ids else ""

    def id_to_piece(self, i: int) -> str:
        """The vocabulary string of token `i` (with `▁` for spaces, `<0xXX>` for bytes)."""
        return self._tokens[i]

    def piece_to_id(self, s: str) -> int | None:
        """The id of vocabulary string `s`, or None."""
        return self._piece_to_id.get(s)

    def token_type(self, i: int) -> int:
        return self._types[i]

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` decodes to (control tokens decode to their own text)."""
        if not 0 <= i < len(self._pieces):
            raise ValueError(f"token id {i} is outside the vocabulary (size {len(self._pieces)})")
        return self._pieces[i]

    # -- encode / decode -------------------------------------------------------------------------
    def _encode(self, text: str) -> Any:
        if not isinstance(text, str):
            raise ValueError(f"can only encode str, not {type(text).__name__}")
        try:
            return self._encode_one(text)
        except TypeError:  # lone surrogates (e.g. from JSON "\ud800") are not valid UTF-8
            return self._encode_one(_SURROGATE.sub("\ufffd", text))

    def _encode_one(self, text: str) -> Any:
        # tokenizers' encode holds the GIL for the whole call (~100 ms for a 20,000-message prompt, when the
        # HTTP loop of the same process waits); encode_batch releases it and gives the same encoding
        if len(text) < LONG_TEXT_CHARS:
            return self._hf.encode(text, add_special_tokens=False)
        return self._hf.encode_batch([text], add_special_tokens=False)[0]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; control tokens written in the text are matched whole."""
        ids = self._encode(text).ids
        return [self.bos_id, *ids] if add_bos else list(ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and their (start, end) character spans in `text` (no BOS added)."""
        enc = self._encode(text)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        return [self.encode(t, add_bos) for t in texts]

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        skip = self.special_ids if skip_special_tokens else ()
        return b"".join(self.token_bytes(i) for i in ids if i not in skip)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 from byte tokens becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")


def _incomplete_tail(data: bytes) -> int:
    """Length of the trailing bytes of `data` that start a character more bytes could still complete
    (0-3). Bytes that can never be valid UTF-8 (a surrogate's `ED A0`, an overlong `E0 80`) are not held."""
    for j in range(1, min(3, len(data)) + 1):
        if data[-j] & 0xC0 != 0x80:  # the last byte that is not a continuation byte
            try:
                data[-j:].decode("utf-8")
            except UnicodeDecodeError as e:
                return j if e.start == 0 and e.reason == "unexpected end of data" else 0
            return 0
    return 0


class IncrementalDetokenizer:
    """Streams text token by token; only the bytes of a character that is still incomplete are held
    back (docs/serving.md, "Streaming"); invalid bytes become U+FFFD at once, as decode() makes them."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 mark_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.mark = mark_special_tokens and not skip_special_tokens
        self._held = b""  # a valid, incomplete UTF-8 character: at most 3 bytes

    def _text(self, b: bytes) -> str:
        data = self._held + b if self._held else b
        try:
            text, self._held = data.decode("utf-8"), b""
            return text
        except UnicodeDecodeError:
            pass
        hold = _incomplete_tail(data)
        self._held = data[len(data) - hold:] if hold else b""
        return data[:len(data) - hold].decode("utf-8", errors="replace")

    def push(self, token_id: int) -> str:
        """New text after `token_id` ('' while a multi-byte character is incomplete)."""
        b = self.tokenizer.token_bytes(token_id)
        if token_id in self.tokenizer.special_ids:
            if self.skip_special_tokens:
                return ""
            if self.mark:  # a dangling partial character before it becomes U+FFFD
                return self.flush() + MARK_OPEN + b.decode("utf-8", errors="replace") + MARK_CLOSE
        text = self._text(b)
        return text.replace(MARK_OPEN, MARK_OPEN + MARK_CLOSE) if self.mark and MARK_OPEN in text else text

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); resets the state."""
        out, self._held = self._held.decode("utf-8", errors="replace"), b""
        return out
