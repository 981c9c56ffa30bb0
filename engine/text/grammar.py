"""Structured output with llguidance: GrammarSpec -> a matcher per request -> a token bitmask per step.

Why llguidance (measured against xgrammar and outlines-core on a 262,144-token vocabulary; docs/api.md
has the table): it compiles a schema or a tool-call grammar in 1-6 ms (xgrammar 80-810 ms, outlines-core
17-176 s), computes a mask in tens of microseconds like xgrammar, has no dependencies, and never lets a
special token match text, which Gemma's `<|"|>`-delimited strings need.

Life of a constraint:
  * the request carries a `GrammarSpec` (plain data); `GrammarBackend.check` compiles it once (cached by
    spec) and raises RequestError for a bad grammar, off the server's event loop;
  * the model runner gives each constrained Req its own `GrammarState` (a copy of the compiled matcher)
    at its first sample, and before every sample brings it up to date with the Req's output ids, so a
    preempted and re-prefilled request resumes exactly where it was;
  * `fill` writes one bitmask row per constrained row of the batch (the others pay nothing), the
    sampler applies it (engine/runner/sampling.py `apply_token_bitmask`);
  * once the grammar is complete only the EOS ids are allowed: the request ends with a stop token;
  * the engine drops the state when the request finishes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from swaserve.engine.core import GrammarSpec, RequestError

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: the server's chat worker processes (server/chat/worker.py) build
# grammar text with json_lark and would otherwise load torch (~200 MB each) for nothing

log = logging.getLogger("swaserve.engine")

# Whitespace a JSON grammar allows between two tokens: one space, or a newline and an indent (compact,
# `json.dumps` and pretty-printed JSON all fit), bounded so that a weak model cannot loop on whitespace.
JSON_WHITESPACE = r"[ ]|\n[ \t]{0,20}"
_CACHE_SIZE = 64


def json_options(strict: bool) -> dict[str, Any]:
    """llguidance JSON compile options (`x-guidance`); non-strict schemas ignore keywords it lacks."""
    return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}


def json_lark(schema: dict[str, Any], strict: bool = False) -> str:
    """A Lark expression `%json {...}` for a JSON schema (to embed in a larger grammar)."""
    sch = dict(schema)
    sch["x-guidance"] = {**json_options(strict), **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(sch, ensure_ascii=False)


class _TokenizerWrapper:
    """What llguidance.LLTokenizer reads from a tokenizer (duck-typed llguidance.TokenizerWrapper)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Any, eos_id: int):
        self._tok = tokenizer
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        # control / unknown / unused tokens: never matched by text in a grammar (only by name, `<|"|>`)
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, s: str | bytes) -> list[int]:
        return self._tok.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)


class GrammarState:
    """One request's matcher; follows the request's output ids (see the module docstring)."""

    def __init__(self, matcher: Any, spec: GrammarSpec):
        self.matcher = matcher
        self.spec = spec
        self.consumed = 0  # output tokens fed to the matcher
        self.failed = False  # the matcher rejected a token: only EOS is allowed from then on

    def sync(self, output_ids: Sequence[int]) -> None:
        """Feed the output tokens the matcher has not seen (rolls back if it saw more)."""
        n = len(output_ids)
        if self.consumed > n:
            if not self.matcher.rollback(self.consumed - n):
                self.matcher.reset()
                self.consumed = 0
            else:
                self.consumed = n
        for tok in output_ids[self.consumed:n]:
            self.consumed += 1
            if self.failed:
                continue
            if not self.matcher.consume_token(int(tok)):
                self.failed = True
                log.warning("grammar rejected token %d: %s; only EOS is allowed from here", tok,
                            self.matcher.get_error()[:300])

    @property
    def done(self) -> bool:
        """The grammar is complete (or failed): only EOS may follow."""
        return self.failed or bool(self.matcher.is_stopped())


class GrammarBackend:
    """Compiles GrammarSpecs for one tokenizer and fills bitmasks (thread-safe compile, loop-thread fill)."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], threads: int | None = None):
        self.tokenizer = tokenizer
        self.eos_ids = sorted({int(i) for i in eos_ids if 0 <= int(i) < tokenizer.vocab_size})
        if not self.eos_ids:
            raise ValueError("a grammar needs at least one EOS token id")
        self.vocab_size = tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask row
        import torch

        self.threads = threads or max(1, torch.get_num_threads())
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._executor: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()  # spec -> fresh matcher (a template)
        eos_row = np.zeros(self.words, dtype=np.uint32)
        for i in self.eos_ids:
            eos_row[i // 32] |= np.uint32(1 << (i % 32))
        self._eos_row = eos_row.view(np.int32)  # the mask of a finished or failed grammar

    # ---- compile ----------------------------------------------------------------------------------
    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                wrapper = _TokenizerWrapper(self.tokenizer, self.eos_ids[0])
                self._lltok = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.eos_ids)
                self._executor = llguidance.LLExecutor(num_threads=self.threads)
            return self._lltok

    def _grammar_text(self, spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.source)
            except json.JSONDecodeError as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}", "response_format") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError("the JSON schema must be an object", "response_format")
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=json_options(False))
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.source)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.source)
        raise RequestError(f"unknown grammar kind {spec.kind!r}", "grammar")

    def _template(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        from llguidance import LLMatcher

        lltok = self._llg_tokenizer()
        text = self._grammar_text(spec)
        err = LLMatcher.validate_grammar(text, lltok)
        if err:
            raise RequestError(f"cannot compile the grammar: {err.splitlines()[0][:500]}", "grammar")
        matcher = LLMatcher(lltok, text, log_level=0)
        if matcher.is_error():
            raise RequestError(f"cannot compile the grammar: {matcher.get_error()[:500]}", "grammar")
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: GrammarSpec) -> None:
        """Compile (or find compiled) `spec`; RequestError when it is not a valid grammar."""
        self._template(spec)

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        template = self._template(spec)
        with self._lock:
            return GrammarState(template.deep_copy(), spec)

    # ---- masks --------------------------------------------------------------------------------------
    def fill(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """One bitmask row per state: int32 [R, ceil(V / 32)], bit t of row r = token t allowed."""
        out = np.empty((len(states), self.words), dtype=np.int32)
        live: list[tuple[Any, int]] = []
        for r, st in enumerate(states):
            if st.failed:
                out[r] = self._eos_row
            else:
                live.append((st.matcher, r))
        if len(live) == 1:
            m, r = live[0]
            m.unsafe_compute_mask_ptr(out[r].ctypes.data, self.words * 4)
        elif live:
            self._llg_tokenizer()
            self._executor.unsafe_compute_mask_ptr(live, out.ctypes.data, self.words * 4, len(states))
        for m, r in live:
            if m.is_error():  # e.g. a resource limit: end the request instead of sampling garbage
                log.warning("grammar error: %s; only EOS is allowed from here", m.get_error()[:300])
                states[r].failed = True
                out[r] = self._eos_row
        import torch

        return torch.from_numpy(out)
