"""N-gram ids of a packed batch: the public entry points and their CPU, GPU and fused kernels."""
