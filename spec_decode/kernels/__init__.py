"""Custom kernels for decoding (compiled on first use; see each module)."""
