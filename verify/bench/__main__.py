"""``python -m verify.bench {gemm,attention,model} [options]``: GPU benchmarks with one comparison table."""

from __future__ import annotations

import importlib
import os
import sys

SUITES = {
    "gemm": "our GEMM kernels against cuBLAS on every projection of a model (decode and prefill)",
    "attention": "prefill and decode attention against PyTorch SDPA",
    "model": "the whole decoder: prefill and decode against its unfused, compiled and HF peers",
}
USAGE = f"usage: python -m verify.bench {{{','.join(SUITES)}}} [options]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nGPU benchmarks, each printing one comparison table:")
        for name, what in SUITES.items():
            print(f"  {name:<10} {what}")
        print("\n`python -m verify.bench SUITE --help` lists a suite's options.")
        return 0
    if not argv or argv[0] not in SUITES:
        print(USAGE, file=sys.stderr)
        what = "a suite is required" if not argv else f"unknown suite {argv[0]!r}"
        print(f"python -m verify.bench: error: {what}; expected one of {', '.join(SUITES)}", file=sys.stderr)
        return 2
    from verify.cli import bad_environment

    if {"-h", "--help"} & set(argv[1:]):  # a suite's help runs no kernel: any backend will do to print it
        os.environ["TRITONCHECK_BACKEND"] = "interpreter"
    elif bad_environment("python -m verify.bench"):
        return 2
    module = importlib.import_module(f"verify.bench.{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    from verify import cli

    cli.exit_with(main)
