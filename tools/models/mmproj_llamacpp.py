"""Our mmproj file in llama.cpp: does its mtmd reader load it, and does its gemma4v graph encode an image
to the same soft tokens as models/gemma4_vision.py? llama.cpp runs in a child process of the python that
has llama-cpp-python (its mtmd bindings, built from the sdist: docs/images.md):

  .venv/bin/python tools/models/mmproj_llamacpp.py --model demo.gguf --mmproj demo.mmproj.gguf \
      --llama-python /tmp/lcpvenv/bin/python

Prints one table: load, projector caps, non-causal image attention, soft tokens per image, and the max
relative error of llama.cpp's image embeddings against ours for the same PNG (sized so that neither side
resizes it: a multiple of patch x pooling within both token budgets).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import sys

import numpy as np


def _image(side: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((side, side), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def llama_cpp_embeddings(model: str, mmproj: str, png: bytes, threads: int) -> dict:
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=threads, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = threads
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, params)
    if not ctx:
        return {"loaded": False}
    out: dict = {"loaded": True, "vision": bool(mtmd.mtmd_support_vision(ctx))}
    buf = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(png), False)
    chunks = mtmd.mtmd_input_chunks_init()
    marker = mtmd.mtmd_default_marker()
    text = mtmd.mtmd_input_text(marker, len(marker), False, True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    out["tokenize_rc"] = rc
    n_embd = llama_cpp.llama_model_n_embd(llm._model.model)
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if mtmd.mtmd_input_chunk_get_type(chunk) == 0:  # text
            out.setdefault("text_tokens", 0)
            out["text_tokens"] += n
            continue
        out["non_causal"] = bool(mtmd.mtmd_decode_use_non_causal(ctx, chunk))
        out["encode_rc"] = mtmd.mtmd_encode_chunk(ctx, chunk)
        ptr = mtmd.mtmd_get_output_embd(ctx)
        out["embd"] = np.ctypeslib.as_array(ptr, shape=(n * n_embd,)).reshape(n, n_embd).copy()
    return out


def our_embeddings(mmproj: str, png: bytes, max_soft_tokens: int | None = None) -> np.ndarray:
    import torch
    from PIL import Image

    from swaserve.models.gemma4_image import prepare_image
    from swaserve.models.gemma4_vision import Gemma4Vision
    from swaserve.models.mmproj import load_mmproj

    cfg, tensors = load_mmproj(mmproj)
    p = prepare_image(Image.open(io.BytesIO(png)), patch_size=cfg.patch_size,
                      pooling_kernel_size=cfg.pooling_kernel_size,
                      max_soft_tokens=max_soft_tokens or cfg.max_soft_tokens)
    enc = Gemma4Vision(cfg, tensors)
    return enc.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids)).numpy()


def _in_child(a: argparse.Namespace, png: bytes) -> dict:
    """llama_cpp_embeddings in `a.llama_python` (its own numpy and llama_cpp), back as a pickle of lists."""
    import pickle
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        img, out = f"{d}/image.png", f"{d}/out.pkl"
        with open(img, "wb") as f:
            f.write(png)
        subprocess.run([a.llama_python, __file__, "--model", a.model, "--mmproj", a.mmproj, "--threads",
                        str(a.threads), "--child", img, out], check=True)
        with open(out, "rb") as f:
            return pickle.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the text GGUF the projector belongs to")
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--side", type=int, default=432,
                    help="image side in pixels (432: 27 x 27 patches, 9 x 9 = 81 soft tokens, a size "
                         "llama.cpp's gemma4v keeps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=sys.executable, help="a python with llama-cpp-python")
    ap.add_argument("--child", nargs=2, metavar=("PNG", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:  # in the llama-cpp-python environment
        import pickle

        with open(a.child[0], "rb") as f:
            res = llama_cpp_embeddings(a.model, a.mmproj, f.read(), a.threads)
        if "embd" in res:
            res["embd"] = res["embd"].tolist()  # plain lists: the other side's numpy may differ
        with open(a.child[1], "wb") as f:
            pickle.dump(res, f)
        return 0
    png = _image(a.side, seed=0)
    theirs = _in_child(a, png)
    if "embd" in theirs:
        theirs["embd"] = np.asarray(theirs["embd"], dtype=np.float32)
    rows = [("llama.cpp loads the mmproj", theirs.get("loaded"))]
    if theirs.get("loaded"):
        got = theirs.get("embd")
        # llama.cpp keeps its own token budget (the file's swaserve.vision.max_soft_tokens is ours): ours
        # gets llama.cpp's count, so that both encode the same pixels when the image needs no resize
        ours = our_embeddings(a.mmproj, png, None if got is None else got.shape[0])
        rows += [("vision input", theirs["vision"]), ("non-causal image attention", theirs["non_causal"]),
                 ("tokenize rc / encode rc", f"{theirs['tokenize_rc']} / {theirs.get('encode_rc')}"),
                 ("soft tokens llama.cpp / swaserve",
                  f"{None if got is None else got.shape[0]} / {ours.shape[0]}")]
        if got is not None and got.shape == ours.shape:
            err = float(np.abs(got - ours).max() / np.abs(ours).max())
            rows.append(("image embeddings max |diff| / max |ours|", f"{err:.2e}"))
    print("| check | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
