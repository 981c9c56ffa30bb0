"""The engine process's compile gate (engine/client/compile_gate.py): a request whose grammar is not
compiled reaches the loop only after a compile thread compiled it; other messages are not held up by it;
an abort of a request still compiling is applied after that request; refused grammars pass on (the
loop's add_request raises the cached refusal); the compile threads have the large stack."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from swaserve.engine.client.compile_gate import COMPILE_STACK_BYTES, CompileGate
from swaserve.engine.client.messages import AbortRequest, AddRequest, FlushCache
from swaserve.engine.core import GrammarSpec, RequestError, SamplingParams


class SlowGrammar:
    """A GrammarBackend stand-in: check() takes `delay` seconds, records its thread and its stack room."""

    def __init__(self, delay: float):
        self.delay = delay
        self.done: set[GrammarSpec] = set()
        self.threads: list[str] = []
        self.lock = threading.Lock()

    def ready(self, spec: GrammarSpec) -> bool:
        with self.lock:
            return spec in self.done

    def check(self, spec: GrammarSpec) -> None:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        with self.lock:
            self.done.add(spec)
        if spec.source == "bad":
            raise RequestError("cannot compile", "grammar")


def _add(seq: int, rid: str, source: str | None) -> AddRequest:
    grammar = GrammarSpec("regex", source) if source is not None else None
    return AddRequest(seq, rid, [1, 2], SamplingParams(grammar=grammar))


def test_compiles_off_the_forwarding_thread_in_order_per_request():
    got: list[object] = []
    arrived = threading.Event()

    def forward(msg: object) -> None:
        got.append(msg)
        if isinstance(msg, AbortRequest):
            arrived.set()

    grammar = SlowGrammar(0.3)
    gate = CompileGate(forward, grammar)
    t0 = time.monotonic()
    gate.put(_add(1, "slow", "[a-z]+"))
    gate.put(AbortRequest("slow"))  # waits for its request
    gate.put(_add(2, "plain", None))  # passes at once
    gate.put(FlushCache(7))
    put_s = time.monotonic() - t0
    assert put_s < 0.1, put_s  # nothing waited for the compile
    assert [type(m).__name__ for m in got] == ["AddRequest", "FlushCache"] and got[0].request_id == "plain"
    assert arrived.wait(10)
    assert [(type(m).__name__, getattr(m, "request_id", None)) for m in got[2:]] == \
        [("AddRequest", "slow"), ("AbortRequest", "slow")]
    assert len(grammar.threads) == 1 and grammar.threads[0].startswith("swaserve-grammar-")
    gate.put(_add(3, "again", "[a-z]+"))  # compiled now: straight through
    assert got[-1].request_id == "again" and len(grammar.threads) == 1
    gate.close()


def test_a_refused_grammar_reaches_the_loop_too():
    got: list[object] = []
    done = threading.Event()
    gate = CompileGate(lambda m: (got.append(m), done.set()), SlowGrammar(0.0))
    gate.put(_add(1, "bad", "bad"))
    assert done.wait(10) and got[0].request_id == "bad"
    gate.close()


def _own_stack_bytes() -> int:
    """The calling thread's stack size, from pthread (Linux)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # a pthread_attr_t (56 bytes on x86-64)
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    size = ctypes.c_size_t()
    libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
    libc.pthread_attr_destroy(attr)
    return size.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the stack size from pthread")
def test_compile_threads_have_the_large_stack():
    seen: dict[str, int] = {}

    class Probe(SlowGrammar):
        def check(self, spec: GrammarSpec) -> None:
            seen["stack"] = _own_stack_bytes()
            super().check(spec)

    before = threading.stack_size()
    done = threading.Event()
    gate = CompileGate(lambda m: done.set(), Probe(0.0))
    gate.put(_add(1, "x", "[0-9]"))
    assert done.wait(10)
    assert seen["stack"] >= COMPILE_STACK_BYTES, seen
    assert threading.stack_size() == before  # restored for every other thread
    gate.close()
