"""Run Triton kernels in the CPU interpreter when there is no GPU (must happen before they are defined)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
