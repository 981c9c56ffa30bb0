"""The decode step's layers in one native call (native_step.c, built into native.py's library): the ctypes
mirrors of its two descriptors and the call.

`StepLayer` holds one layer's weight and pool pointers (built once per model and pool by
models/gemma4_step.py, which keeps the tensors alive); `Step` one step's rows, plans and scratch.
Pointers are plain integers: the caller guarantees every tensor is CPU, contiguous where the C code says
so, and of the shapes native_step.c documents.
"""

from __future__ import annotations

import ctypes

from swaserve.engine.quant import native

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

_LAYER_POINTERS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "pre_ffw_norm_2",
                   "post_ffw_norm_1", "post_ffw_norm_2", "post_ffw_norm", "router_rw", "router_w",
                   "expert_scale", "wq", "wk", "wv", "wo", "wgate", "wup", "wdown", "moe_gu", "moe_dn",
                   "kc", "vc")


class StepLayer(ctypes.Structure):
    _fields_ = [*((n, _P) for n in _LAYER_POINTERS),
                *((n, _I) for n in ("k_rs", "k_hs", "kt", "v_rs", "v_hs", "vt", "kind", "D", "KVH")),
                ("scalar", _D)]


class Step(ctypes.Structure):
    _fields_ = [("h", _P), *((n, _I) for n in ("T", "H", "NH", "FF", "MI", "E", "TOPK", "nthreads")),
                ("eps", _D), ("cos", _P * 2), ("sin", _P * 2), ("rope_n", _I * 2), ("rope_half", _I * 2),
                ("store_slots", _P * 2), ("rows", _P * 2), ("slots", _P * 2), ("counts", _P * 2),
                ("S", _I * 2), *((n, _P) for n in ("x", "q", "k", "v", "a", "gu", "m1", "m2", "wts", "ids"))]


def available() -> bool:
    """Whether the library is built and its descriptors are the size these mirrors say."""
    lib = native.load()
    return lib is not None and lib.swa_step_sizes() == ctypes.sizeof(StepLayer) * 1000 + ctypes.sizeof(Step)


def run(layers: ctypes.Array, step: Step) -> None:
    """Every layer of `layers` (a StepLayer array) over the step's rows; step.h is updated in place."""
    native.load().swa_decode_step(layers, len(layers), ctypes.byref(step))
