"""Prompts longer than the context, refused before they are rendered or tokenized.

No token covers more characters than the vocabulary's longest piece (max_token_chars): a text of C
characters is at least C / max_token_chars tokens, whatever the tokenizer makes of it (a byte-fallback
token covers at most one character; a control token its own text). So a prompt of more than
context_length * max_token_chars characters cannot fit, and is a 400 before any work or memory is spent
on it (check_chars). A chat prompt counts the content of its system, developer, user and tool messages,
which the template renders (stripped of surrounding whitespace: a template may trim it); assistant
messages are not counted (templates drop their reasoning). The same 400 as the engine's length check,
with `code: context_length_exceeded`."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from swaserve.server.errors import APIError

CONTEXT_CODE = "context_length_exceeded"
_BYTE = 6  # the GGUF token type of byte-fallback tokens
_COUNTED_ROLES = ("system", "developer", "user", "tool")
_cache: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _compute(tok: Any) -> int | None:
    n = tok.vocab_size
    longest, byte_tokens = 1, 0
    for i in range(n):
        if tok.token_type(i) == _BYTE:
            byte_tokens += 1  # one byte: at most one character
            continue
        longest = max(longest, len(tok.id_to_piece(i)))  # `▁` stands for one space: one character
    if byte_tokens < 256 and getattr(tok, "unk_id", None) is not None:
        return None  # characters without a byte token fall to one fused <unk> of any length: no bound
    return longest


def max_token_chars(tok: Any) -> int | None:
    """The most characters one token of `tok` covers (None: no bound known, e.g. a test double)."""
    if not all(hasattr(tok, a) for a in ("vocab_size", "token_type", "id_to_piece")):
        return None
    try:
        with _lock:
            if tok in _cache:
                return _cache[tok]
    except TypeError:  # not weakly referable: computed each time
        return _compute(tok)
    value = _compute(tok)
    with _lock:
        _cache[tok] = value
    return value


def context_error(message: str, param: str | None) -> APIError:
    return APIError(400, message, param, CONTEXT_CODE)


def check_chars(chars: int, context_length: int | None, tok: Any, param: str) -> None:
    """400 when `chars` characters of prompt text cannot fit in `context_length` tokens."""
    if context_length is None or chars <= context_length:
        return
    per = max_token_chars(tok)
    if per is None or chars <= context_length * per:
        return
    least = -(-chars // per)
    raise context_error(
        f"the prompt has at least {least} tokens ({chars} characters, at most {per} per token), which does "
        f"not leave room for any completion within the context length of {context_length} tokens", param)


def check_tokens(count: int, context_length: int | None, param: str | None) -> None:
    """400 when a prompt of `count` tokens leaves no room for a completion (the engine's own check)."""
    if context_length is not None and count >= context_length:
        raise context_error(f"the prompt has {count} tokens, which does not leave room for any completion "
                            f"within the context length of {context_length} tokens", param)


def message_chars(messages: Iterable[dict[str, Any]]) -> int:
    """Characters of the message content a template renders (see the module's docstring)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if m.get("role") in _COUNTED_ROLES and isinstance(content, str):
            total += len(content.strip())
    return total
