"""Triton kernels of the decoder, one module per op family, with thin launch wrappers."""

from ops import backend

backend.configure()
