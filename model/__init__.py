"""The decoder: config, safetensors loading, reference and Triton models, CUDA Graph decode."""
