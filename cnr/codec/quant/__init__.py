"""Quantization kernels: the greedy range search, row-wise quantization, bit packing."""
