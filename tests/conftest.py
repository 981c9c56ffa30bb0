"""Suite-wide: run Triton kernels in the CPU interpreter when there is no GPU.

This must happen before any test module imports a kernel module (triton reads it when the
kernels are defined), so it lives in the top conftest, not only beside the kernel tests.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
