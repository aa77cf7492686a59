"""Triton kernels: the engine's hot paths on CUDA, checked against the torch reference (on the CPU through
`TRITON_INTERPRET=1`)."""
