"""Torch references (fp32/fp64, written for clarity). Never imports the kernels they check."""
