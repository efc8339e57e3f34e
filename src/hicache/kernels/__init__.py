"""Compute kernels outside torch: the CPU paged decode attention (C++, built at first use)."""
