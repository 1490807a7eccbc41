"""Triton kernels, one file per op; the backend interface is backends/triton_backend.py."""
