"""Compile every Triton kernel configuration the backends launch for a CUDA target without a GPU.

    python -m tools.gpu_check.triton_aot [--arch 89 90] [--plain]

By default each kernel is compiled with the specialisation Triton applies at run time: every
pointer argument 16-byte aligned and every integer argument divisible by 16 (the variant the JIT
builds for the 26b-a4b shapes, whose sizes and strides are multiples of 16; it is the one that
unrolls and vectorises most, so the one with the most registers). `--plain` compiles without it.

Catches what the CPU interpreter cannot: type errors of the GPU code path (tl.dot operand types),
and resource use (shared memory against the chip's limit, registers, stack/spills read from the
cubin with the cuobjdump that Triton's wheel carries). Must run without TRITON_INTERPRET.
Exit status 1 if any configuration fails to compile or exceeds the shared-memory limit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024}  # bytes per block (opt-in maximum)


def configs(arch: int = 90) -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """(name, kernel, pointer/scalar types, constexprs, num_warps, num_stages) as the backends launch them
    on sm_<arch>."""
    from swaserve.engine.attention import triton_kernels as attention_kernels
    from swaserve.engine.moe import triton_backend as moe_kernels
    from swaserve.engine.quant import triton_q4 as linear_kernels

    out = []
    att = dict(
        q_ptr="*bf16",
        k_ptr="*bf16",
        v_ptr="*bf16",
        kw_ptr="*i16",
        vw_ptr="*i16",
        o_ptr="*bf16",
        blk_seq_ptr="*i32",
        blk_start_ptr="*i32",
        cu_q_ptr="*i32",
        prefix_ptr="*i32",
        pt_ptr="*i64",
        kend_ptr="*i32",
        sm_scale="fp32",
        dec_seq_ptr="*i32",
        po_ptr="*fp32",
        plse_ptr="*fp32",
    )
    for D, G in ((256, 2), (512, 8)):  # Gemma 4: 16/8 heads at 256, 16/2 at 512
        shared = SHARED_LIMIT.get(arch, 99 * 1024)
        # KV types: K_TYPE / V_TYPE 0 float, 1 q8_0 (bytes), 2 fp8 (engine/attention/triton_kernels.py)
        for kv, ptr, kt in (("bf16", "*bf16", 0), ("fp16", "*fp16", 0), ("fp32", "*fp32", 0),
                            ("q8_0", "*u8", 1), ("fp8_e4m3", "*fp8e4nv", 2)):
            t = dict(att, k_ptr=ptr, v_ptr=ptr)
            types = dict(DOT_F32=kv == "fp32", K_TYPE=kt, V_TYPE=kt)
            bm, bn, w, st = attention_kernels.prefill_block_sizes(D, G, shared, q8=kt == 1)
            # BIDIR (bidirectional image attention) only on sliding layers (triton_backend.py), whose
            # head dim is 256 in Gemma 4
            variants = [(True, False), (False, False)] + ([(True, True)] if D == 256 else [])
            for sliding, bidir in variants:
                c = dict(G=G, PAGE=16, D=D, BLOCK_M=bm, BLOCK_N=bn, SLIDING=sliding, BIDIR=bidir,
                         **types)
                name = f"attn prefill D{D} kv {kv} {'swa' if sliding else 'full'}{' bidir' * bidir}"
                out.append(
                    (
                        name,
                        attention_kernels._prefill_kernel,
                        t,
                        c,
                        w,
                        st,
                    )
                )
            dbn, dw, dst = attention_kernels.decode_block_sizes(D)
            c = dict(G=G, BLOCK_G=16, PAGE=16, D=D, BLOCK_N=dbn, SLIDING=True, **types)
            out.append((f"attn decode D{D} kv {kv}", attention_kernels._decode_kernel, t, c, dw, dst))
        reduce = attention_kernels._decode_reduce_kernel
        out.append((f"attn reduce D{D}", reduce, att, dict(D=D, BLOCK_S=64), 4, 3))
    q = dict(x_ptr="*bf16", wb_ptr="*u8", wh_ptr="*fp16", y_ptr="*bf16", part_ptr="*fp32")
    from swaserve.engine.quant.triton_blocks import FMT_Q4_0_PAIRS

    linear_formats = ((FMT_Q4_0_PAIRS, "q4_0r"), (linear_kernels.FMT_Q4_0, "q4_0"),
                      (linear_kernels.FMT_Q8_0, "q8_0"))
    for fmt, qn in linear_formats:
        for m in (1, 2, 4):
            bm, bn, bk = linear_kernels.gemv_blocks(m)
            c = dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            out.append((f"{qn} gemv M{m}", linear_kernels._gemv_kernel, q, c, 4, 3))
        for m in (8, 32, 64, 2048):
            bm, bn, bk, w = linear_kernels.gemm_blocks(m)
            for xt in ("bf16", "fp16"):
                t = dict(q, x_ptr="*" + xt, y_ptr="*" + xt)
                c = dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=False)
                out.append((f"{qn} gemm M{m} x {xt}", linear_kernels._gemm_kernel, t, c, w, 3))
    # every other block format: one GEMV, one GEMM and the two MoE kernels each (the tile decoder is
    # the only difference between formats; the full grid above covers the tile shapes)
    others = [(f, n.lower()) for n, f in linear_kernels.WEIGHT_FORMATS.items()
              if f not in (linear_kernels.FMT_FLOAT, linear_kernels.FMT_Q4_0, linear_kernels.FMT_Q8_0)]
    for fmt, qn in others:
        bm, bn, bk = linear_kernels.gemv_blocks(1)
        out.append((f"{qn} gemv M1", linear_kernels._gemv_kernel, q, dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn,
                                                                          BLOCK_K=bk), 4, 3))
        bm, bn, bk, w = linear_kernels.gemm_blocks(64)
        c = dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=False)
        out.append((f"{qn} gemm M64 x bf16", linear_kernels._gemm_kernel, q, c, w, 3))
    mt = dict(
        x_ptr="*bf16",
        wb_ptr="*u8",
        wh_ptr="*fp16",
        act_ptr="*bf16",
        sorted_ptr="*i32",
        block_e_ptr="*i32",
        eoff_ptr="*i64",
        out_ptr="*fp32",
        topw_ptr="*fp32",
    )
    moe_formats = (
        (FMT_Q4_0_PAIRS, "q4_0r"),
        (linear_kernels.FMT_Q4_0, "q4_0"),
        (linear_kernels.FMT_Q8_0, "q8_0"),
        (linear_kernels.FMT_FLOAT, "bf16"),
    )
    for fmt, qn in moe_formats + tuple(others):
        t = dict(mt, wb_ptr="*bf16", wh_ptr="*bf16") if fmt == linear_kernels.FMT_FLOAT else mt
        for tk in ((8, 16384) if (fmt, qn) in moe_formats else (8,)):
            bm, bn, bk, w = moe_kernels.moe_blocks(tk, 128)
            for ind in ((False, True) if fmt == FMT_Q4_0_PAIRS else (False,)):
                c = dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=False, INDIRECT=ind)
                tag = " offload" if ind else ""
                out.append((f"moe gate_up {qn} BM{bm}{tag}", moe_kernels._gate_up_kernel, t, c, w, 3))
                out.append((f"moe down {qn} BM{bm}{tag}", moe_kernels._down_kernel, t, c, w, 3))
    out += fused_configs()
    return out


def fused_configs() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """engine/fused's kernels (the CUDA decode path) and the split-K sum, as launched at 26b-a4b shapes."""
    import triton

    from swaserve.engine.fused import moe_kernels as fm
    from swaserve.engine.fused import norm_kernels as fn
    from swaserve.engine.quant import triton_q4

    f32 = dict(eps="fp32", router_scalar="fp32")
    rows = dict(f32, x_ptr="*fp32", w_ptr="*fp32", out_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32",
                w_pa_ptr="*fp32", w_ffn_ptr="*fp32", w_moe_ptr="*fp32", w_router_ptr="*fp32",
                x_ffn_ptr="*bf16", x_moe_ptr="*bf16", x_router_ptr="*fp32", m1_ptr="*bf16", m2_ptr="*fp32",
                w1_ptr="*fp32", w2_ptr="*fp32", w_post_ptr="*fp32", scalar_ptr="*fp32", w_next_ptr="*fp32",
                x_next_ptr="*bf16")
    block = triton.next_power_of_2(2816)
    out: list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]] = [
        ("fused rms_norm H2816", fn.rms_norm_kernel, rows, dict(HAS_W=True, BLOCK=block), 4, 1),
        ("fused post_attention H2816", fn.post_attention_kernel, rows, dict(BLOCK=block), 4, 1),
        ("fused layer_tail H2816", fn.layer_tail_kernel, rows, dict(HAS_NEXT=True, BLOCK=block), 4, 1),
    ]
    heads = dict(f32, x_ptr="*bf16", w_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16",
                 k_ptr="*bf16", v_ptr="*bf16", wk_ptr="*fp32", slots_ptr="*i64", kc_ptr="*bf16",
                 vc_ptr="*bf16")
    for d in (256, 512):
        out.append((f"fused q norm_rope D{d}", fn.norm_rope_kernel, heads, dict(HALF=d // 2), 4, 1))
        out.append((f"fused kv store D{d} kv bf16", fn.kv_store_kernel, heads, dict(HALF=d // 2), 4, 1))
    moe = dict(x_ptr="*fp32", w_ptr="*fp32", pes_ptr="*fp32", ids_ptr="*i64", wout_ptr="*fp32",
               g_ptr="*bf16", u_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_e_ptr="*i32")
    out.append(("fused router E128 K8", fm.router_kernel, moe, dict(E=128, K=8, BLOCK_H=64), 4, 1))
    out.append(("fused gelu_mul", fm.gelu_mul_kernel, moe, dict(BLOCK=1024), 4, 1))
    for tk in (8, 256, fm.ALIGN_MAX_ASSIGNMENTS):
        c = dict(E=128, BLOCK_M=16, BLOCK_TK=max(16, tk), BLOCK_NB=16)
        out.append((f"fused moe_align TK{tk}", fm.moe_align_kernel, dict(moe, ids_ptr="*i64"), c, 4, 1))
    out.append(("split-K sum", triton_q4._split_sum_kernel, dict(part_ptr="*fp32", y_ptr="*bf16"),
                dict(BLOCK=1024), 4, 1))
    return out


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) of the kernel in a cubin, via Triton's cuobjdump (None if unavailable)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        r = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, timeout=60
        )
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def global_loads(ptx: str) -> tuple[int, int]:
    """(vector, scalar) global load instructions in a kernel's PTX: `ld.global...v2/v4` and the
    asynchronous copies to shared memory (`cp.async`, 4-16 bytes each) vs the other `ld.global`:
    whether a weight tile is read with vector loads."""
    loads = re.findall(r"ld\.global[\w.]*|cp\.async\.\w+\.shared\.global", ptx)
    vec = sum(1 for ld in loads if ".v2" in ld or ".v4" in ld or ld.startswith("cp.async"))
    return vec, len(loads) - vec


def required(name: str) -> bool:
    """Configurations that must compile without spills and within shared memory: everything the
    default CUDA path of gemma-4-26B-A4B launches (bf16/fp16 KV; Q4_0 repacked (q4_0r), or in the
    file's layout (q4_0: the offload backend); Q8_0/float weights; the fused kernels). fp32 KV
    attention and the other block types' kernels are reported (WARN) only."""
    if "kv fp32" in name:
        return False
    first = name.split()[0]
    if first in ("attn", "moe", "fused", "split-K"):
        return not name.startswith("moe ") or any(f" {q} " in name for q in ("q4_0r", "q4_0", "q8_0", "bf16"))
    return first in ("q4_0r", "q4_0", "q8_0")


def runtime_attrs(fn: Any, types: dict[str, str], consts: dict[str, Any]) -> dict[tuple[int], list]:
    """The JIT's specialisation: tt.divisibility 16 on pointers (torch allocations are aligned) and on
    integer arguments (sizes and strides of the 26b-a4b shapes are multiples of 16)."""
    attrs: dict[tuple[int], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            continue
        ty = types.get(name, "i32")
        if ty.startswith("*") or ty in ("i32", "i64"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_all(arch: int = 90, only: str | None = None, specialise: bool = True) -> int:
    """Compile every configuration for sm_<arch>, print one line each; returns the number of failures
    (a compile error, shared memory over the chip's limit, or spills: a stack frame)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("triton_aot: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    limit = SHARED_LIMIT.get(arch, 99 * 1024)
    failed = 0
    for name, fn, types, consts, warps, stages in configs(arch):
        if only and only not in name:
            continue
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        cidx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        attrs = runtime_attrs(fn, types, consts) if specialise else None
        src = ASTSource(fn=fn, signature=sig, constexprs=cidx, attrs=attrs)
        t0 = time.monotonic()
        try:
            k = triton.compile(
                src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
            )
        except Exception as e:  # report and go on
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[-1500:]}", flush=True)
            continue
        shared = int(k.metadata.shared)
        regs, stack = _resource_usage(k.asm["cubin"])
        vec, narrow = global_loads(k.asm["ptx"])
        over, spills = shared > limit, bool(stack)
        bad = over or spills
        warn = bad and not required(name)
        failed += bad and not warn
        note = ("  (over the shared-memory limit)" if over else "") + ("  (spills)" if spills else "")
        print(
            f"{'WARN' if warn else 'FAIL' if bad else 'ok  '} sm_{arch} {name:38s} shared {shared:>6d} B  "
            f"regs {regs}  stack {stack} B  loads v{vec}/{narrow}{note}  [{time.monotonic() - t0:.1f}s]",
            flush=True,
        )
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile the Triton kernels for a CUDA arch without a GPU")
    p.add_argument("--arch", type=int, nargs="+", default=[89, 90],
                   help="compute capabilities as ints (89 = RTX 40xx / L4, 90 = H100/H200)")
    p.add_argument("--only", default=None, help="only configurations whose name contains this")
    p.add_argument("--plain", action="store_true", help="compile without the run-time specialisation")
    args = p.parse_args(argv)
    failed = sum(compile_all(a, args.only, not args.plain) for a in args.arch)
    print(f"{failed} configuration(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
