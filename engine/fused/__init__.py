"""Device-picking model ops: fused Triton kernels on CUDA (and in the interpreter when asked), the
plain torch ops elsewhere. The model calls these instead of choosing a path itself."""
