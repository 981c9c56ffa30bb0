"""Where llguidance stops coping with a schema: the crash thresholds behind server/chat/schema_limits.py.

    python -m tools.serving.grammar_limits [--target json|gemma] [--kinds refchain,anyof,...] [--stack-mb 8]

Each probe runs in a subprocess of its own (a native stack overflow is a SIGSEGV): it builds one schema
of a kind at size N, turns it into the grammar the server would send (`json`: response_format through
llguidance's JSON schema support; `gemma`: a tool whose parameters are the schema, under tool_choice
required, server/chat/tool_grammar.py), compiles it with the demo tokenizer on a thread with
--stack-mb of stack (8 MiB: a Linux main thread), computes the first token mask, and reports ok / error
(a clean llguidance or Python error) / crash (the process died) with the compile and first-mask CPU
seconds. Python's recursion limit is lifted in the probe (the server never recurses that deep: its
limits come first), so what is measured is llguidance's. Sizes double from --start until a crash or
--max, then the first crash is bisected. The kinds:

  refchain   $defs d0 -> d1 -> ... -> dN, each just a $ref to the next
  refnest    each $def an object whose one property is a $ref to the next
  depth      arrays nested N deep, inline
  objdepth   objects nested N deep, inline
  anyof      one anyOf with N object branches
  anyofnest  anyOf nested N deep
  plainrefs  N properties, each a $ref to one $def
  props      N optional string properties
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

KINDS = ("refchain", "refnest", "depth", "objdepth", "anyof", "anyofnest", "plainrefs", "props")


def schema_text(kind: str, n: int) -> str:
    """The schema as JSON text (built as text: deep nesting would overflow json.dumps)."""
    if kind == "refchain":
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return json.dumps({"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": defs})
    if kind == "refnest":
        defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return json.dumps({"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": defs})
    if kind in ("depth", "objdepth", "anyofnest"):
        head, tail = {
            "depth": ('{"type": "array", "items": ', "}"),
            "objdepth": ('{"type": "object", "properties": {"a": ', "}}"),
            "anyofnest": ('{"anyOf": [{"type": "null"}, ', "]}"),
        }[kind]
        inner = head * n + '{"type": "integer"}' + tail * n
        return '{"type": "object", "properties": {"v": ' + inner + "}}"
    if kind == "anyof":
        return json.dumps({"type": "object", "properties": {"v": {"anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(n)]}}})
    if kind == "plainrefs":
        return json.dumps({"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/a"} for i in range(n)},
                           "$defs": {"a": {"type": "string", "maxLength": 4}}})
    if kind == "props":
        return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4}
                                                            for i in range(n)}})
    raise ValueError(kind)


CHILD = r"""
import json, sys, threading, time
import numpy as np
import llguidance
from llguidance import LLMatcher
from swaserve.engine.text.grammar import _TokenizerWrapper, json_options
from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from tools.serving.grammar_limits import schema_text

kind, n, target, stack_mb = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
sys.setrecursionlimit(10**6)  # past Python's own limit: the probe is for what llguidance does
text = schema_text(kind, n)
tok = Tokenizer.from_metadata(demo_tokenizer_metadata())
lltok = llguidance.LLTokenizer(_TokenizerWrapper(tok, 1), n_vocab=tok.vocab_size, eos_token=[1])
out = {"bytes": len(text)}

def run():
    try:
        t0 = time.process_time()
        if target == "json":
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=json_options(False))
        else:
            from swaserve.server.chat.tool_grammar import tool_calls_lark
            tool = {"type": "function", "function": {"name": "f", "parameters": json.loads(text)}}
            grammar = LLMatcher.grammar_from_lark(tool_calls_lark([tool], parallel=False, thinking=False))
        m = LLMatcher(lltok, grammar, log_level=0)
        t1 = time.process_time()
        out["compile_s"] = round(t1 - t0, 3)
        if m.is_error():
            out["status"], out["error"] = "error", m.get_error()[:160]
            return
        mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        out["mask_s"] = round(time.process_time() - t1, 3)
        out["status"] = "error" if m.is_error() else "ok"
        if m.is_error():
            out["error"] = m.get_error()[:160]
    except BaseException as e:  # a Python-side failure (RecursionError, ValueError): clean
        out["status"], out["error"] = "error", f"{type(e).__name__}: {str(e)[:160]}"

threading.stack_size(stack_mb << 20)
t = threading.Thread(target=run)
t.start()
t.join()
print(json.dumps(out), flush=True)
"""


def probe(kind: str, n: int, target: str, stack_mb: int) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", CHILD, kind, str(n), target, str(stack_mb)],
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"status": "crash", "rc": p.returncode, "n": n}
    line = p.stdout.strip().splitlines()[-1]
    return {**json.loads(line), "n": n}


def threshold(kind: str, target: str, stack_mb: int, start: int, top: int) -> tuple[int | None, list]:
    """(the smallest crashing N found, every probe's result)."""
    seen = []
    n, ok = start, 0
    while n <= top:
        r = probe(kind, n, target, stack_mb)
        seen.append(r)
        print(f"  {kind} n={n}: {r}", flush=True)
        if r["status"] == "crash":
            break
        ok, n = n, n * 2
    else:
        return None, seen
    lo, hi = ok, n
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        r = probe(kind, mid, target, stack_mb)
        seen.append(r)
        print(f"  {kind} n={mid}: {r}", flush=True)
        lo, hi = (lo, mid) if r["status"] == "crash" else (mid, hi)
    return hi, seen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["json", "gemma"], default="json")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--stack-mb", type=int, default=8)
    ap.add_argument("--start", type=int, default=64)
    ap.add_argument("--max", type=int, default=16384)
    a = ap.parse_args(argv)
    for kind in a.kinds.split(","):
        crash, _ = threshold(kind, a.target, a.stack_mb, a.start, a.max)
        found = f"no crash up to {a.max}" if crash is None else f"crashes from ~{crash}"
        print(f"{a.target} {kind}: {found} (stack {a.stack_mb} MiB)", flush=True)


if __name__ == "__main__":
    main()
