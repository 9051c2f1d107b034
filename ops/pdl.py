"""Programmatic dependent launch (PDL, Hopper and later): overlap a kernel's start with the end
of the kernel before it in the stream.

A decode step is ~180 small launches (177 for the article config), each paying a launch, a ramp
(programs starting, the first loads' round trip) and a tail (the last programs finishing) that a
single kernel cannot hide.
Launched with PDL, a kernel may start as soon as every program of the one before it has called
:func:`release`; it stops in :func:`wait` until that kernel has completed and its writes are
visible. CUDA Graph capture keeps these programmatic edges.

Where to release was measured on the H200 (article decode step, ms/token; 1.045 without PDL):
the small kernels release at their start and the GEMV after its K loop (0.898). Releasing the
GEMV at its start measured 1.176 (the next kernels' programs then hold SM slots while it still
streams); releasing the small kernels, or the GEMV, only at exit 0.98; an L2 prefetch of the
GEMV's weight rows before its wait 0.936 (every line is then requested twice). Later (2026-11-30,
one run, each variant twice): a one-step GEMV loading its weight chunk into registers before its
wait 0.841 against 0.834 without (weights are read-only, so that would be allowed; it buys
nothing), and releasing right after that load 1.225, so neither was kept then. Again on 94f3bfb (one
call, each twice): that preload in every one-step GEMV 0.729 against 0.694 without; with the
o_proj GEMV (a fifth of a wave) also releasing at its start, so gate_up's programs are resident
and loading while it streams, 0.724; and down releasing early too, 0.727. The preload in the
o_proj GEMV alone, whose predecessors (attention's split and combine) leave DRAM idle, did win
(2026-12-01: 0.632 against 0.650; qkv's too, 0.632), as did down's once it streamed in one step
(Qwen3's step 0.645 against 0.715 with o_proj's): see ``ops.gemm.linear``'s ``static_weight``.
The attention split kernel asking L2 for its first K/V tile before its wait won too (2026-12-02:
0.622 against 0.630), where loading that tile into registers there had lost (0.641 against 0.632).

The contract every kernel launched with :func:`launch_options` keeps, in every program:

* nothing before :func:`wait` reads memory an earlier kernel may have written, and nothing before
  it writes memory at all (the one read let through: a gemv's weight chunk, K pieces included,
  under its ``EARLY_WEIGHT`` constexpr, set only when the caller promised, by
  ``linear(static_weight=True)``, that no kernel still running writes that weight; and
  :func:`prefetch_l2`, which reads nothing into the program);
* :func:`wait` is reached unconditionally, so a kernel's completion implies its predecessor's,
  and a kernel two launches later that reads our inputs' producers is still ordered after them.

``TRITONCHECK_PDL=0`` launches everything plainly (for comparison); on the interpreter and before
Hopper PDL is off and the ``PDL`` constexpr compiles the calls away.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ops import backend

ENV_VAR = "TRITONCHECK_PDL"


@functools.cache
def enabled() -> bool:
    """True when kernels are compiled for a GPU that supports PDL and it is not switched off."""
    if backend.is_interpreter() or os.environ.get(ENV_VAR, "1") == "0":
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def launch_options() -> dict[str, bool]:
    """``kernel[grid](..., **launch_options())``: the launch flag and the kernel's ``PDL``
    constexpr, so its :func:`wait` and :func:`release` compile in exactly when it is launched so."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel in the stream start (it still waits for our completion to read)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs`` (``prefetch.global.L2``): a hint that moves no data
    into the program, so it may come before :func:`wait` whatever is writing there (L2 is where
    writes land: a prefetched line is never stale). Compiled kernels only: the interpreter has no
    inline assembly, so callers put it under a constexpr that is off there."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
