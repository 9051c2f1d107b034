"""Timing the way the model runs: kernels back to back inside a CUDA Graph, weights rotated.

A standalone launch on the H200 costs ~20 us from Python, more than a decode-size kernel, so
decode-size kernels are timed as many launches captured in one graph, replayed and divided.
Each launch in the graph reads its own copy of the weights, with enough copies to exceed 3x
the 60 MB L2, so the numbers are HBM numbers, not cache numbers.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ops import pdl

L2_BYTES = 60 * 2**20


def copies_for(nbytes: int, minimum: int = 4, l2_multiple: int = 3) -> int:
    """How many copies of an operand of ``nbytes`` rotate through more than ``l2_multiple`` x L2."""
    return max(minimum, -(-l2_multiple * L2_BYTES // max(nbytes, 1)) + 1)


def graph_time_per_call(calls: Sequence[Callable[[], object]], replays: int = 20, warmup: int = 3) -> float:
    """Seconds per call: every call captured once, back to back, in one CUDA Graph; median replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile and autotune-free warm-up outside capture
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(calls)


@triton.jit
def _empty_kernel(PDL: tl.constexpr):
    """Nothing but the dependency every model kernel keeps: start early, wait for the one before."""
    pdl.release(PDL)
    pdl.wait(PDL)


def launch_floor(launches: int, dependent: bool = True) -> float:
    """Seconds for ``launches`` launches of an empty kernel (two programs per SM, as the model's
    kernels have about) replayed from one CUDA Graph, each waiting for the one before through
    PDL as the model's do (``dependent``, where PDL is on) or launched plainly. The time a chain
    of that many kernels takes whatever they compute: launching, scheduling, waiting."""
    grid = (2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,)
    options = pdl.launch_options() if dependent else {"PDL": False}
    return graph_time_per_call([lambda: _empty_kernel[grid](**options)] * launches) * launches


def empty_launch_seconds(chain: int = 64) -> float:
    """One empty kernel's share of a chain of dependent launches (PDL as the model): no kernel
    timed in such a chain, as the benchmarks time them, can take less."""
    return launch_floor(chain) / chain


def bench_median(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Seconds per call of ``fn`` launched from Python (triton's do_bench, median)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def cuda_missing(prog: str) -> bool:
    """True, after saying so on stderr, when there is no CUDA GPU to benchmark on (checked
    after the arguments are parsed, so ``--help`` and usage errors work anywhere)."""
    if torch.cuda.is_available():
        return False
    print(f"{prog}: benchmarks need a CUDA GPU", file=sys.stderr)
    return True


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Measured device memory bandwidth in bytes/s: a large kernel copy, bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = bench_median(lambda: dst.copy_(src))
    return 2 * nbytes / seconds


def bf16_matmul_peak(n: int = 8192) -> float:
    """Measured dense bf16 matmul rate in FLOP/s (random data: zeros run faster)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / bench_median(lambda: a @ b)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def targets_table(targets: Sequence[dict]) -> str:
    """An issue's targets (``target``, ``value``, ``met``) as a table: reported, not enforced."""
    return table(
        ["target", "value", "met"], [[t["target"], t["value"], "yes" if t["met"] else "no"] for t in targets]
    )
