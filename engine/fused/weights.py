"""Weight forms prepared once at load for the device path, and the fp32-output lm_head."""

from __future__ import annotations

import torch

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import FLOAT_TYPES
from swaserve.engine.quant.linear import linear
from swaserve.engine.quant.q4_repack import repack_weight

_FLOAT_NAMES = {dtype: name for name, dtype in FLOAT_TYPES.items()}


def float_weight_to(w: QWeight, device: torch.device, dtype: torch.dtype | None) -> QWeight:
    """A float QWeight on `device` stored in `dtype` (converted once here, so no call converts it;
    None keeps the stored dtype); block-quantized weights are moved (their kernels dequantize in the
    compute dtype), Q4_0 repacked on CUDA into the kernels' aligned layout (engine/quant/q4_repack.py)."""
    if w.qtype not in FLOAT_TYPES or dtype is None:
        if w.data.device != device:
            w = QWeight(w.qtype, w.shape, w.data.to(device), w.name, layout=w.layout)
        return repack_weight(w) if device.type == "cuda" else w  # Q4_0: aligned rows for vector loads
    if w.data.device == device and w.data.dtype == dtype:
        return w
    data = w.data.to(device=device, dtype=dtype)  # one conversion at load
    return QWeight(_FLOAT_NAMES[dtype], w.shape, data, w.name)


def logits_fp32(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [N, H] @ W^T -> fp32 [N, V] with the fp32 accumulation kept in the output (no rounding of
    the logits to bf16). A float weight is used in its stored dtype and x is cast to it ([N, H],
    small), never the [V, H] weight (an F16 embedding stays exact for the input lookup too)."""
    if x.is_cuda:
        if w.qtype in FLOAT_TYPES:
            xw = x.to(w.data.dtype)  # [N, H]
            if xw.dtype in (torch.bfloat16, torch.float16):
                return torch.mm(xw, w.data.t(), out_dtype=torch.float32)  # cuBLAS, fp32 out
            return torch.mm(xw, w.data.t())
        from swaserve.engine.quant import triton_q4

        if w.qtype in triton_q4.WEIGHT_FORMATS:
            return triton_q4.quant_linear(x, w, out_dtype=torch.float32)
    return linear(x, w).float()
