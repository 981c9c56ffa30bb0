"""The device path's generic pieces: Triton kernels (norm_kernels, moe_kernels), the device-kernels switch
and linear (ops), the weight forms made at load (weights). models/gemma4_fused.py wires them into a layer."""
