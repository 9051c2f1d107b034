"""``python -m verify.bench {gemm,attention,model} [options]``: GPU benchmarks with one comparison table."""

from __future__ import annotations

import importlib
import sys

SUITES = ("gemm", "attention", "model")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(
            f"usage: python -m verify.bench {{{','.join(SUITES)}}} [options]",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(f"verify.bench.{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
