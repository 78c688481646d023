"""Host side of each op on CUDA: allocate outputs, fetch compiled kernels, launch (see docs/ARCHITECTURE.md)."""
