"""Structured output with llguidance: GrammarSpec -> a matcher per request -> a token bitmask per step.

Why llguidance (measured against xgrammar and outlines-core on a 262,144-token vocabulary; docs/api.md
has the table): it compiles a schema or a tool-call grammar in 1-6 ms (xgrammar 80-810 ms, outlines-core
17-176 s), computes a mask in tens of microseconds like xgrammar, has no dependencies, and never lets a
special token match text, which Gemma's `<|"|>`-delimited strings need.

Life of a constraint:
  * the server builds the `GrammarSpec` (plain data) in a chat worker process, after its limits
    (server/chat/schema_limits.py), and compiles it there once first (engine/text/grammar_check.py): a
    grammar that crashes llguidance kills that worker, not the engine;
  * `GrammarBackend.check` compiles it in the engine (cached by spec, failures too) and raises
    RequestError for a bad grammar; the engine process compiles on a thread of its own before the step
    loop sees the request (engine/client/compile_gate.py), so no compile stalls other users' steps;
  * the model runner gives each constrained Req its own `GrammarState` (a copy of the compiled matcher)
    at its first sample, and before every sample brings it up to date with the Req's output ids, so a
    preempted and re-prefilled request resumes exactly where it was;
  * `fill` writes one bitmask row per constrained row of the batch (the others pay nothing), the
    sampler applies it (engine/runner/sampling.py `apply_token_bitmask`);
  * once the grammar is complete only the EOS ids are allowed: the request ends with a stop token; a
    matcher that fails (an llguidance error, a rejected token) fails its request (GrammarFailed, an
    error to the client), it does not end it as if complete;
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

from swaserve.engine.core import GrammarFailed, GrammarSpec, RequestError

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: the server's chat worker processes (server/chat/worker.py) build
# grammar text with json_lark and would otherwise load torch (~200 MB each) for nothing

log = logging.getLogger("swaserve.engine")

# Whitespace a JSON grammar allows between two tokens: one space, or a newline and an indent (compact,
# `json.dumps` and pretty-printed JSON all fit), bounded so that a weak model cannot loop on whitespace.
JSON_WHITESPACE = r"[ ]|\n[ \t]{0,20}"
_CACHE_SIZE = 64
ERROR_CHARS = 300  # of an llguidance error, in a message
# llguidance's parser limits, the same wherever a grammar is compiled. A row of the Earley parser holds
# every item that may come next: an object whose n properties are all optional has ~4n (JSON) or ~3n
# (Gemma) at its `{`; the default (2,000) fails 500 optional properties mid-generation. The server allows
# 1,000 optional properties per object (server/chat/schema_limits.py); the per-step cap on items
# (50,000, llguidance's default) still bounds every mask.
MAX_ITEMS_IN_ROW = 8000


def json_options(strict: bool) -> dict[str, Any]:
    """llguidance JSON compile options (`x-guidance`); non-strict schemas ignore keywords it lacks."""
    return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}


def json_lark(schema: dict[str, Any], strict: bool = False) -> str:
    """A Lark expression `%json {...}` for a JSON schema (to embed in a larger grammar)."""
    sch = dict(schema)
    sch["x-guidance"] = {**json_options(strict), **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(sch, ensure_ascii=False)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (what LLMatcher compiles); RequestError when it is unreadable."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as e:
            raise RequestError(f"the JSON schema is not valid JSON: {e}", "response_format") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("the JSON schema must be an object", "response_format")
        return LLMatcher.grammar_from_json_schema(spec.source, defaults=json_options(False))
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    raise RequestError(f"unknown grammar kind {spec.kind!r}", "grammar")


DEAD_END = "no token can continue the output (a part of the schema admits no value)"


def first_line(error: str) -> str:
    """An llguidance error without the parser state it appends (a multi-line dump)."""
    line = error.split("\n<state>", 1)[0].strip().split("\n", 1)[0][:ERROR_CHARS]
    return DEAD_END if line == "NoExtensionBias" else line  # llguidance's word for a dead end


def compile_matcher(lltok: Any, spec: GrammarSpec) -> Any:
    """A fresh LLMatcher for spec (llguidance drops the GIL while it compiles); RequestError when the
    grammar does not compile."""
    from llguidance import LLMatcher, LLParserLimits

    matcher = LLMatcher(lltok, grammar_text(spec), log_level=0,
                        limits=LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW))
    if matcher.is_error():
        raise RequestError(f"cannot compile the grammar: {first_line(matcher.get_error())}", "grammar")
    return matcher


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
        self.error: str | None = None  # why the matcher failed; only EOS is allowed from then on

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
            if self.error is not None:
                continue
            if not self.matcher.consume_token(int(tok)):
                why = first_line(self.matcher.get_error())
                self.error = f"the grammar rejected token {int(tok)}: {why}"

    @property
    def failed(self) -> bool:
        return self.error is not None

    def failure(self) -> GrammarFailed | None:
        """The request's error once the matcher failed."""
        if self.error is None:
            return None
        return GrammarFailed(f"the structured-output grammar failed during generation: {self.error}")

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
        self._refused: OrderedDict[GrammarSpec, RequestError] = OrderedDict()  # spec -> why it failed
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

    def _template(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            refused = self._refused.get(spec)
        if refused is not None:  # a failure is not compiled again (the compile gate already tried)
            raise RequestError(str(refused), refused.param)
        lltok = self._llg_tokenizer()
        try:
            matcher = compile_matcher(lltok, spec)
            # the first mask builds the lexer states every copy shares: here, not in a step's fill
            mask = np.empty(self.words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, self.words * 4)
            if matcher.is_error():
                raise RequestError(f"cannot compile the grammar: {first_line(matcher.get_error())}",
                                   "grammar")
        except RequestError as e:
            with self._lock:
                self._refused[spec] = e
                while len(self._refused) > _CACHE_SIZE:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: GrammarSpec) -> None:
        """Compile (or find compiled) `spec`; RequestError when it is not a valid grammar."""
        self._template(spec)

    def ready(self, spec: GrammarSpec) -> bool:
        """Whether check(spec) answers at once (compiled, or refused, before)."""
        with self._lock:
            return spec in self._compiled or spec in self._refused

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
            if st.error is not None:
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
            if m.is_error():  # e.g. a resource limit: the request fails (the runner reads st.error)
                states[r].error = first_line(m.get_error())
                out[r] = self._eos_row
            elif not out[r].any():  # a dead end (a part of the schema no value satisfies)
                states[r].error = DEAD_END
                out[r] = self._eos_row
        import torch

        return torch.from_numpy(out)
