"""Image encoder time: N images one forward each (`Gemma4Vision.encode`, what the runner did before) against
one batched forward (`encode_batch`, what engine/runner/images.py does for images of one patch count), on a
random tower (models/mmproj.py random_vision), fp32, on the CPU threads given:

  .venv/bin/python tools/models/encode_batch_time.py --size tiny --images 4 --side 336 --threads 2
  .venv/bin/python tools/models/encode_batch_time.py --size real --images 4 --side 448 --threads 2

Prints one markdown row: tower, patches an image, single (sum of N forwards), batched, speed-up, and the
max |batched - single| / max |single| of the outputs. Times are the median of --repeats,
the two sides interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch
from PIL import Image

from swaserve.models.gemma4_image import prepare_image
from swaserve.models.gemma4_vision import Gemma4Vision, VisionConfig
from swaserve.models.mmproj import random_vision, tiny_vision_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny",
                    help="tiny: the demo tower (64 wide, 2 layers, <= 64 soft tokens); "
                         "real: Gemma 4's (768, 16, 280)")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--side", type=int, default=336, help="square image side in pixels before preprocessing")
    ap.add_argument("--max-soft-tokens", type=int, default=None,
                    help="the tower's soft-token budget an image (default: the tower's, 64 / 280)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_vision_config(2816) if args.size == "tiny" else VisionConfig(text_hidden_size=2816)
    if args.max_soft_tokens is not None:
        cfg = dataclasses.replace(cfg, max_soft_tokens=args.max_soft_tokens)
    tower = Gemma4Vision(cfg, random_vision(cfg, seed=0))
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(args.images):
        img = Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))
        p = prepare_image(img, patch_size=cfg.patch_size, pooling_kernel_size=cfg.pooling_kernel_size,
                          max_soft_tokens=cfg.max_soft_tokens)
        pairs.append((torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids)))

    def run_single() -> None:
        for pv, pos in pairs:
            tower.encode(pv, pos)

    def run_batched() -> None:
        tower.encode_batch(pairs)

    run_single(), run_batched()  # warm-up
    ts: dict[str, list[float]] = {"single": [], "batched": []}
    for _ in range(args.repeats):  # interleaved: a machine whose load drifts biases neither side
        for name, fn in (("single", run_single), ("batched", run_batched)):
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    single, batched = statistics.median(ts["single"]), statistics.median(ts["batched"])
    one = [tower.encode(pv, pos) for pv, pos in pairs]
    err = max(float((b - o).abs().max() / o.abs().max()) for b, o in zip(tower.encode_batch(pairs), one))
    print("| tower | images x patches (soft tokens) | threads | single, sum | batched | speed-up "
          "| max rel diff |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.size} ({cfg.hidden_size} wide, {cfg.num_layers} layers) | {args.images} x "
          f"{pairs[0][0].shape[0]} ({one[0].shape[0]}) | {args.threads} | {single * 1e3:.1f} ms | "
          f"{batched * 1e3:.1f} ms | "
          f"{single / batched:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
