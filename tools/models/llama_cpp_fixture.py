"""Write tests/data/tiny-llamacpp-q4_0.gguf: the `tiny` preset (seed 0) written in F32 by swaserve, then
quantized to Q4_0 by llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python), so the
file's layout, metadata and quantized blocks come from llama.cpp's GGUF code, not from gguf-py.

    .venv/bin/python -m tools.models.llama_cpp_fixture --llama-python /path/to/python-with-llama_cpp

tests/models/test_llama_cpp_fixture.py reads the result (and, when llama_cpp is importable, compares
llama.cpp's logits with swaserve's on an F32 file).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from swaserve.models.demo.tiny import make_model

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-llamacpp-q4_0.gguf"
QUANTIZE = """
import ctypes, sys
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
p.nthread = 1
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
sys.exit(rc)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a Python interpreter that imports llama_cpp")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        src = str(Path(d) / "tiny-f32.gguf")
        print(f"writing the tiny preset (seed 0, F32) to {src}", flush=True)
        make_model("tiny", src, seed=0, progress=True, qtype="F32")
        print(f"quantizing with llama.cpp to {args.out}", flush=True)
        subprocess.run([args.llama_python, "-c", QUANTIZE, src, args.out], check=True)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
