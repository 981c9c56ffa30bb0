"""Keep some decoder layers of a gemma4 GGUF (renumbered 0..n-1): a shallow model for accuracy checks.

  .venv/bin/python tools/models/trunc_gguf.py small.gguf small-2L.gguf --layers 0,5
The random presets amplify any perturbation ~2.5x per layer, so on the full 12-layer `small` every
non-exact path (llama.cpp's included) sits ~1 nat from the exact one; a 2-layer cut (one sliding and one
full layer) ranks the paths (docs/kernels.md, accuracy). Per-layer metadata arrays are subset, block_count
set; tokenizer and global tensors are copied unchanged (the copy recipe of gguf-py's gguf_new_metadata).
"""

from __future__ import annotations

import argparse
import re

import gguf


def truncate(src: str, dst: str, keep: list[int]) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    per_layer = {f"{arch}.attention.head_count_kv", f"{arch}.attention.sliding_window_pattern"}
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name in per_layer and isinstance(val, list):
            val = [val[i] for i in keep]
        if f.name == f"{arch}.block_count":
            val = len(keep)
        w.add_key_value(f.name, val, kind, sub_type=sub)
    tensors = []
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m:
            if int(m.group(1)) not in keep:
                continue
            tensors.append((f"blk.{keep.index(int(m.group(1)))}.{m.group(2)}", t))
        else:
            tensors.append((t.name, t))
    for name, t in tensors:
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layers", default="0,5", help="layer indices to keep, comma-separated (default 0,5)")
    args = p.parse_args()
    keep = [int(x) for x in args.layers.split(",")]
    truncate(args.src, args.dst, keep)
    print(f"wrote {args.dst}: {len(keep)} layers")


if __name__ == "__main__":
    main()
