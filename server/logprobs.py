"""Logprobs in the OpenAI formats (chat and legacy completions), with the text and bytes of each token
memoised per tokenizer (TokenText)."""

from __future__ import annotations

import math
import weakref
from typing import Any

from swaserve.engine.core import TokenLogprob


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, list[int]]]] = weakref.WeakKeyDictionary()


class TokenText:
    """Token id -> its text (special tokens included) and its own bytes, memoised for the tokenizer (one
    table shared by all requests, at most one entry per vocabulary id).

    Detokenizing is CPU work: the routes `warm` the ids an output's logprobs name (each token and its
    alternatives) on a worker thread (RouteCtx.prepare) before formatting them, so the event loop only
    looks them up."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        try:
            self.cache = _TOKEN_TEXTS.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that takes no weak reference: a table for this request only
            self.cache = {}

    def _entry(self, tid: int) -> tuple[str, list[int]]:
        e = self.cache.get(tid)
        if e is None:
            e = (self.tok.decode([tid], skip_special_tokens=False), list(self.tok.token_bytes(tid)))
            self.cache[tid] = e
        return e

    def __call__(self, tid: int) -> str:
        return self._entry(tid)[0]

    def bytes(self, tid: int) -> list[int]:
        """The token's own bytes (a byte-fallback token is one byte, not U+FFFD's three)."""
        return self._entry(tid)[1]

    def missing(self, lps: list[TokenLogprob]) -> list[int]:
        """The ids in `lps` (tokens and alternatives) not memoised yet."""
        c = self.cache
        out = [lp.token_id for lp in lps if lp.token_id not in c]
        out.extend(i for lp in lps for i, _ in lp.top if i not in c)
        return out

    def warm(self, ids: list[int]) -> None:
        """Detokenize `ids` into the table (on a worker thread)."""
        for i in ids:
            self._entry(i)


def chat_logprobs(lps: list[TokenLogprob], text: TokenText, k: int) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        t = text(lp.token_id)
        out.append({"token": t, "logprob": _lp(lp.logprob), "bytes": text.bytes(lp.token_id),
                    "top_logprobs": [{"token": text(i), "logprob": _lp(v), "bytes": text.bytes(i)}
                                     for i, v in lp.top[:k]]})
    return out


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, k: int, offset: int) -> dict[str, Any]:
    """Legacy completions format; `offset` is the text offset of the first token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = text(lp.token_id)
        tokens.append(t)
        token_lps.append(_lp(lp.logprob))
        tops.append({text(i): _lp(v) for i, v in lp.top[:k]} if k > 0 else None)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
