"""Compile a grammar once where a native crash costs only the caller (a chat worker process), exactly as
the engine will compile it (engine/text/grammar.py `compile_matcher`), and compute its first token mask.

llguidance compiles by recursion in native code; a grammar that overflows the stack kills the process
(SIGSEGV). The server's limits (server/chat/schema_limits.py) refuse what is known to do that; this
check is the second line: it runs on a thread with CHECK_STACK_BYTES of stack, less than the engine's
compile threads get (engine/client/compile_gate.py), so a grammar that would crash the engine crashes
the worker first, and the request fails alone. It also turns a grammar that fails at its first mask, or
admits no token at all, into a 400 before generation, instead of an empty 200.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from swaserve.engine.core import GrammarSpec, RequestError
from swaserve.engine.text.grammar import DEAD_END, _TokenizerWrapper, compile_matcher, first_line

CHECK_STACK_BYTES = 8 << 20  # a Linux main thread's; the engine compiles with 8x as much
FORCED_TOKENS = 256  # forced tokens followed before the second mask
_lock = threading.Lock()
_lltoks: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer), a few


def llg_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer of an engine Tokenizer, built once per process (~1 s for 262k tokens)."""
    import llguidance

    with _lock:
        hit = _lltoks.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    eos = sorted(tokenizer.eos_ids) or [0]
    lltok = llguidance.LLTokenizer(_TokenizerWrapper(tokenizer, eos[0]), n_vocab=tokenizer.vocab_size,
                                   eos_token=eos)
    with _lock:
        if len(_lltoks) >= 2:
            _lltoks.pop(next(iter(_lltoks)))
        _lltoks[id(tokenizer)] = (tokenizer, lltok)
    return lltok


def _check(spec: GrammarSpec, lltok: Any, vocab_size: int) -> list[str]:
    matcher = compile_matcher(lltok, spec)
    warnings = list(matcher.get_grammar_warnings())
    words = (vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    for _ in range(2):  # the first mask, and the one after the tokens the grammar forces (a call's head)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        if matcher.is_error():
            raise RequestError(f"cannot compile the grammar: {first_line(matcher.get_error())}", "grammar")
        if not mask.any() and not matcher.is_accepting():
            raise RequestError(f"cannot compile the grammar: {DEAD_END}", "grammar")
        forced = matcher.compute_ff_tokens()[:FORCED_TOKENS]
        if not forced or not matcher.consume_tokens(forced):
            break
    return warnings


def check_grammar(spec: GrammarSpec, tokenizer: Any) -> list[str]:
    """Compile `spec` and compute its first mask on a thread with CHECK_STACK_BYTES of stack: RequestError
    when it does not compile, fails at once or admits nothing; otherwise llguidance's warnings (keywords
    a lenient JSON schema asked for that it does not enforce)."""
    lltok = llg_tokenizer(tokenizer)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["warnings"] = _check(spec, lltok, tokenizer.vocab_size)
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            out["error"] = e

    with _lock:  # the stack size applies to the threads started while it is set
        old = threading.stack_size(CHECK_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="swaserve-grammar-check", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in out:
        raise out["error"]
    return out["warnings"]
