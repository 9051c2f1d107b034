"""Benchmarks: ``python -m verify.bench gemm|attention|model`` (GPU only)."""
