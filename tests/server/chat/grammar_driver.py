"""A random model under a grammar, without a model: sample allowed tokens from the matcher's mask with the
demo tokenizer, then read the output back the way the server does (whole and streamed), and validate it
with real JSON-schema validators (python-jsonschema when installed, and jsonschema_rs with formats)."""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import numpy as np

from swaserve.engine.core import GrammarSpec
from swaserve.engine.text.grammar import compile_matcher
from swaserve.engine.text.grammar_check import llg_tokenizer
from swaserve.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.server.chat.reasoning import ChatOutputParser


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(demo_tokenizer_metadata())


@functools.lru_cache(maxsize=1)
def _closers() -> np.ndarray:
    """Token ids whose text ends something (a bracket, a comma, a quote, the call's close)."""
    tok = tokenizer()
    ids = [i for i in range(tok.vocab_size)
           if any(c in tok.token_bytes(i).decode("utf-8", "replace") for c in '}],"')
           or tok.token_bytes(i) in (b'<|"|>', b"<tool_call|>")]
    return np.array(sorted(ids))


def allowed(mask: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row allows."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:tokenizer().vocab_size])


def sample(spec: GrammarSpec, rng: random.Random, cap: int = 400) -> list[int] | None:
    """Token ids a random model writes under `spec` until the grammar lets it stop with EOS (EOS not
    included); None when it did not finish within `cap` tokens. Biased toward ending: EOS when allowed
    (half the time), tokens that close something (half the rest), else any allowed token."""
    tok = tokenizer()
    m = compile_matcher(llg_tokenizer(tok), spec)
    words = (tok.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    out: list[int] = []
    closers = _closers()
    eos = np.array(sorted(tok.eos_ids))  # <eos>, <turn|>, <|tool_response>: the grammar's stop tokens
    for _ in range(cap):
        m.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        assert not m.is_error(), m.get_error()[:500]
        ok = allowed(mask)
        assert len(ok), "a mask with no token allowed"
        stops = np.intersect1d(ok, eos)
        if len(stops) and (len(stops) == len(ok) or rng.random() < 0.5):
            assert m.is_accepting()
            return out
        ok = np.setdiff1d(ok, eos, assume_unique=True)
        near = np.intersect1d(ok, closers, assume_unique=True)
        pick = int(rng.choice(list(near)) if len(near) and rng.random() < 0.5 else rng.choice(list(ok)))
        assert m.consume_token(pick), m.get_error()[:500]
        out.append(pick)
    return None


def read(ids: list[int], tools: bool, streamed: bool) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(tool name, arguments JSON)]) as the chat route reads the output: text decoded with
    special tokens marked, through ChatOutputParser, token by token (streamed) or in one piece."""
    det = IncrementalDetokenizer(tokenizer(), skip_special_tokens=False, mark_special_tokens=True)
    pieces = [det.push(i) for i in ids] + [det.flush()]
    parser = ChatOutputParser(tools)
    deltas = [parser.feed(p) for p in pieces] if streamed else [parser.feed("".join(pieces))]
    deltas.append(parser.finish())
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            slot = calls.setdefault(c.index, ["", ""])
            slot[0] = c.name or slot[0]
            slot[1] += c.arguments
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def validators(schema: Any) -> list[Any]:
    """Real validators of `schema`: jsonschema_rs with format checks, python-jsonschema when installed."""
    import jsonschema_rs

    out = [jsonschema_rs.validator_for(schema, validate_formats=True)]
    try:
        import jsonschema
    except ImportError:
        return out
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    out.append(cls(schema, format_checker=cls.FORMAT_CHECKER))
    return out


def assert_valid(schema: Any, text: str) -> Any:
    """Parse `text` as JSON and validate it with every validator; returns the value."""
    value = json.loads(text)
    for v in validators(schema):
        errors = [str(e)[:300] for e in v.iter_errors(value)]
        assert not errors, (schema, text, errors)
    return value
