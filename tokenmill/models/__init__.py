"""The model: one transformer for every family, its quantized weights, the native
descriptors and the choice of decode path."""
