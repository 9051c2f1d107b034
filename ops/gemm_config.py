"""Which launch configuration each GEMM shape gets: fixed ahead of time, never autotuned.

``linear`` and the fused norm+GEMM ops look a shape up as ``(M bucket, N, K)`` in ``CONFIGS``, a
table chosen by measurement on the H200 (``python -m verify.bench gemm --sweep`` prints it ready
to paste), and fall back to ``default_config``'s guesses for shapes it does not list. Autotuning
at run time would benchmark inside CUDA Graph capture.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import triton

from ops import backend

KERNELS = ("gemv", "tiled")
GEMV_MAX_M = 4  # the gemv kernel keeps next_power_of_2(M) rows of x per program
MAX_SPLIT_K = 64  # the reduce unrolls over the splits
MAX_WARPS = 32  # 1024 threads, a CUDA block's most
SMS = 132  # H200 streaming multiprocessors: sizes the default split-K


@dataclass(frozen=True)
class GemmConfig:
    """One fixed launch configuration.

    ``kernel`` is ``"gemv"`` (M <= 4; ``block_m`` is ignored, the kernel takes
    ``next_power_of_2(M)`` rows) or ``"tiled"``. ``num_stages`` pipelines the K loop's loads.
    ``split_k`` > 1 writes fp32 partials and adds a reduce launch.
    """

    kernel: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"config.kernel: expected one of {KERNELS}, got {self.kernel!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"config.{name}: expected a power of two, got {value}")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"config.split_k: expected 1..{MAX_SPLIT_K}, got {self.split_k}")
        if self.num_warps > MAX_WARPS:
            raise ValueError(f"config.num_warps: expected at most {MAX_WARPS}, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"config.num_stages: expected at least 1, got {self.num_stages}")

    def replace(self, **changes: int | str) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, text: str) -> GemmConfig:
        """The config :meth:`describe` writes, e.g. ``"gemv n8 k512 w4 s4"``."""
        match = _DESCRIBED.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"config {text!r}: expected e.g. 'gemv n8 k512 w4 s4' or 'tiled 64x128 k64 splitK2 w4 s3'"
            )
        g = {name: int(value) for name, value in match.groupdict().items() if value is not None}
        kernel, block_m = ("gemv", 1) if "gemv_n" in g else ("tiled", g["m"])
        block_n = g["gemv_n"] if "gemv_n" in g else g["n"]
        return cls(kernel, block_m, block_n, g["k"], g.get("split", 1), g["w"], g["s"])

    def describe(self) -> str:
        tile = f"n{self.block_n}" if self.kernel == "gemv" else f"{self.block_m}x{self.block_n}"
        split = f" splitK{self.split_k}" if self.split_k > 1 else ""
        return f"{self.kernel} {tile} k{self.block_k}{split} w{self.num_warps} s{self.num_stages}"


_DESCRIBED = re.compile(
    r"(?:gemv n(?P<gemv_n>\d+)|tiled (?P<m>\d+)x(?P<n>\d+))"
    r" k(?P<k>\d+)(?: splitK(?P<split>\d+))? w(?P<w>\d+) s(?P<s>\d+)"
)  # what GemmConfig.describe writes

# A shape's M is looked up as the first bucket >= M (4096 stands for every M above 256).
M_BUCKETS = (1, 4, 16, 64, 256, 4096)


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def gemv_config(n: int, k: int, split: int = 1, w: int = 4, s: int = 3) -> GemmConfig:
    """The M=1 path: ``n`` outputs a program, the weight read in ``k``-wide chunks."""
    return GemmConfig("gemv", 1, n, k, split, w, s)


def tiled_config(m: int, n: int, k: int, split: int = 1, w: int = 4, s: int = 3) -> GemmConfig:
    """The tiled path: ``[m, n]`` output tiles, ``k``-wide steps."""
    return GemmConfig("tiled", m, n, k, split, w, s)


# (M bucket, N, K) -> config for every projection of the article config, Qwen3-0.6B and
# Qwen2.5-0.5B, decode (M=1) and prefill (M=256), each picked by measurement on the H200 (the
# comments below say how). Shapes it does not list get ``default_config``'s guesses, made
# before any measurement (132 SMs, ~4.3 TB/s, ~790 TFLOP/s bf16):
# Decode guesses: K <= 1024 is read in one BLOCK_K step with plain 16-byte loads (num_stages=1:
# nothing to pipeline), so all of a program's weight bytes are in flight at once; small N gets
# BLOCK_N=4 (N=1024 -> 256 programs, ~2 per SM). At M=1 a longer K is read the same way (since
# 2026-12-07, following the measured picks below): in one step where it can be (K's power of
# two up to 4096, or one plus whole pieces, k_pieces), else in 4096-wide steps, never through a
# pipelined loop's cp.async copies, which drop the weight's evict_first hint (ops/gemm.py). M of
# 2-4, or too few programs, loop with cp.async pipelining (3 stages of 4 x 512 per program keep
# ~3 MB in flight GPU-wide, the bandwidth x latency product), splitting K to fill the GPU.
# Prefill guesses: 128x128 tiles where they give >= ~130 tiles, else 64-wide tiles or split-K.
CONFIGS: dict[tuple[int, int, int], GemmConfig] = {
    # Chosen by `python -m verify.bench gemm --sweep --preset all` on an NVIDIA H200,
    # 2026-11-29 (each config checked against torch before it was timed; M=1 timed as graph
    # replays over weight copies rotated past 3x L2). Comments: our time, cuBLAS's, without PDL.
    # Re-swept on 2026-11-30 with programmatic dependent launch (ops.pdl): the sweep's own
    # winners then (qkv/o gemv n4 k1024 w4, gate_up n16 k512 w4 s3) were within 0.07 us of these
    # picks alone but made the decode step slower (0.934 vs 0.899 ms/token, in two runs); that
    # was before one-step gemvs ran straight-line (now every decode projection is one step, lm_head
    # too since 2026-12-07; their current times are in PERFORMANCE.md).
    # article: hidden 1024, heads 8/2 x 128, intermediate 4864, vocab 151936
    # qkv at 4 outputs a program (the sweep's pick with PDL): 0.842 vs 0.853 and 0.841 vs 0.854
    # ms/token beside the n2 w2 pick in two calls (3 and 5 timings); o_proj the same, no gain
    (1, 1536, 1024): gemv_config(4, 1024, 1, 4, 1),  # qkv_proj
    (256, 1536, 1024): tiled_config(64, 64, 128, 1, 4, 3),  # qkv_proj 5.92 us, cuBLAS 5.12 us
    (1, 1024, 1024): gemv_config(2, 1024, 1, 2, 1),  # o_proj 2.81 us, cuBLAS 7.57 us
    (256, 1024, 1024): tiled_config(64, 64, 128, 1, 4, 3),  # o_proj 5.77 us, cuBLAS 4.91 us
    # gate_up in one K step (the straight-line path: 79 registers since the 2-D tile, 75 before,
    # 6 programs per SM, against 117 and 4 for the pipelined n8 k512 s4 the sweep chose at
    # 8.33 us): in one call, 3 decode-step timings each, 0.856 ms/token vs 0.944 with the
    # pipelined one (H200, 2026-11-30)
    (1, 9728, 1024): gemv_config(8, 1024, 1, 4, 1),  # gate_up_proj
    (256, 9728, 1024): tiled_config(128, 128, 64, 1, 8, 3),  # gate_up_proj 15.09 us, cuBLAS 11.79 us
    # down was n2 k256 w2 s8 (2 warps, 256-wide chunks 8 deep), which had beaten the n2/n8 k512
    # w4 s4 and n4 k512 w4 s3 before it in the decode step (H200, 2026-11-30): article 0.681 and
    # 0.682 vs 0.693 and 0.694 ms/token (against a copy, same call); in one process Qwen2.5 shape
    # 0.626 vs 0.646, Qwen3 shape 0.735 vs 0.740.
    # Then (2026-12-01) in one K step of whole pieces, 4096 + 512 + 256 (k_pieces), so
    # that static_weight's early request applies: 0.652 vs 0.660 ms/token in one process (n1 k4096
    # w4 0.657, n2 k4096 w8 0.665, n1 k4096 w2 0.666, n4 k4096 w8 0.675; one masked 8192-lane
    # step 0.662-0.683 vs 0.655); Qwen2.5 shape 0.544 vs 0.552 (n1 k4096 w4 0.548, w8 0.552).
    # Against a copy of the code before, same call: 0.631 vs 0.632-0.633 and 0.520 vs 0.521, so
    # the step barely moves; alone down took 4.52 us against 4.81
    (1, 1024, 4864): gemv_config(2, 4096, 1, 4, 1),  # down_proj
    (256, 1024, 4864): tiled_config(64, 64, 64, 4, 4, 4),  # down_proj 11.75 us, cuBLAS 10.58 us
    # lm_head in one K step, although the pipelined n16 k512 w4 s3 (75.73 us, cuBLAS 79.38 us)
    # was as fast in the step: its cp.async copies drop the weight's evict_first hint, and the
    # 311 MB at normal priority flush the KV cache and activations from L2 (ops/gemm.py _gemv_kernel)
    (1, 151936, 1024): gemv_config(4, 1024, 1, 4, 1),  # lm_head
    (256, 151936, 1024): tiled_config(128, 128, 64, 1, 8, 3),  # lm_head 149.02 us, cuBLAS 120.22 us
    # Qwen3-0.6B: hidden 1024, heads 16/8 x 128, intermediate 3072 (lm_head as the article's)
    (1, 4096, 1024): gemv_config(4, 1024, 1, 4, 1),  # qkv_proj 5.07 us, cuBLAS 5.42 us (2026-11-29)
    (256, 4096, 1024): tiled_config(64, 128, 64, 1, 4, 4),  # qkv_proj 7.81 us, cuBLAS 6.37 us
    # (in the Qwen3 step, 2026-11-30, one process: this table 0.733 ms/token; o_proj n2 k256 w2 s8
    # 0.750, n2 k512 w2 s4 0.743, n4 k256 w2 s8 0.745; qkv n8 k1024 0.749, n2 k1024 w2 0.759)
    # o_proj and down in one K step (down masked, 3072 of 4096 lanes), so that static_weight's
    # early request applies to them (H200, 2026-12-01, one process): 0.672 ms/token against 0.724
    # for o_proj n2 k1024 w2 in two steps and down n2 k256 w2 s8; o_proj alone one step 0.689;
    # down n2 k4096 w4 0.673, n1 k4096 w4 0.677; in whole pieces, 2048 + 1024, n2 k2048 w4 0.676,
    # w8 0.681 vs 0.672. (The article's and Qwen2.5's down lost as one masked step, K = 4864 in
    # 8192 lanes, 0.662-0.683 vs 0.655 and 0.560-0.565 vs 0.549, and gained in whole pieces.)
    (1, 1024, 2048): gemv_config(2, 2048, 1, 4, 1),  # o_proj
    (256, 1024, 2048): tiled_config(64, 64, 64, 4, 4, 4),  # o_proj 8.22 us, cuBLAS 6.51 us
    (1, 6144, 1024): gemv_config(8, 1024, 1, 4, 1),  # gate_up_proj, one K step: 0.813 vs 0.870 ms/token
    (256, 6144, 1024): tiled_config(128, 128, 64, 1, 4, 4),  # gate_up_proj 9.61 us, cuBLAS 7.88 us
    (1, 1024, 3072): gemv_config(2, 4096, 1, 8, 1),  # down_proj
    (256, 1024, 3072): tiled_config(64, 64, 64, 4, 4, 4),  # down_proj 9.50 us, cuBLAS 7.85 us
    # Qwen2.5-0.5B: hidden 896, heads 14/2 x 64, intermediate 4864, QKV bias
    # qkv at 4 outputs a program as the article's (2 rotation pairs): 0.614 vs 0.623 ms/token in
    # one process (H200, 2026-11-30); o_proj at 2 outputs 0.624, lm_head n16 k256 0.627: not kept
    (1, 1152, 896): gemv_config(4, 1024, 1, 4, 1),  # qkv_proj
    (256, 1152, 896): tiled_config(64, 64, 128, 1, 4, 3),  # qkv_proj 5.81 us, cuBLAS 5.05 us
    (1, 896, 896): gemv_config(4, 1024, 1, 4, 1),  # o_proj 2.71 us, cuBLAS 4.68 us (2026-11-29)
    (256, 896, 896): tiled_config(64, 64, 128, 1, 4, 3),  # o_proj 5.49 us, cuBLAS 4.69 us
    (1, 9728, 896): gemv_config(8, 1024, 1, 4, 1),  # gate_up_proj, one K step: 0.699 vs 0.798 ms/token
    (256, 9728, 896): tiled_config(128, 128, 64, 1, 8, 3),  # gate_up_proj 14.16 us, cuBLAS 11.18 us
    (1, 896, 4864): gemv_config(2, 4096, 1, 4, 1),  # down_proj, in pieces as the article's
    (256, 896, 4864): tiled_config(64, 64, 64, 4, 4, 4),  # down_proj 11.47 us, cuBLAS 10.45 us
    (1, 151936, 896): gemv_config(4, 1024, 1, 4, 1),  # lm_head in one K step, as the article's
    (256, 151936, 896): tiled_config(128, 128, 64, 1, 8, 3),  # lm_head 133.55 us, cuBLAS 106.37 us
}


def _fill_split(programs: int, k: int, block_k: int) -> int:
    """The smallest power-of-two split that gives ~2 programs per SM, keeping >= 2 K blocks per split."""
    split = 1
    while split * 2 <= 8 and programs * split < 2 * SMS and k >= split * 4 * block_k:
        split *= 2
    return split


def k_pieces(k: int, block_k: int) -> tuple[int, int]:
    """K past a first ``block_k`` chunk as one or two smaller powers of two, at least 16 each
    (4864 = 4096 + 512 + 256 -> (512, 256)), so one step reads it unmasked; (0, 0) where
    ``block_k`` is not K's largest power of two or the rest needs more or smaller pieces.
    Taken by ``num_stages=1`` configs (one step: nothing to pipeline) whose block_k < K."""
    rest = k - block_k
    if not 0 < rest < block_k:
        return 0, 0
    parts = [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]
    if len(parts) > 2 or parts[-1] < 16:
        return 0, 0
    return parts[0], parts[1] if len(parts) == 2 else 0


# A guessed M=1 decode config with K > 1024 reads at most this many weight elements a program a
# step: the measured picks' sizes (n8 k1024, n2 k4096). One step is at most DECODE_MAX_K wide (at
# 4 warps a k8192 chunk held 147 registers, x's 64 elements a thread beside the weight's; at 8 the
# 256-wide piece of K = 8960 was read in 2-byte loads: scripts/compile_sm90.py, 2026-12-07); a K
# that takes several steps walks DECODE_STEP_K at a time (Qwen2.5-1.5B's down_proj, K = 8960, in
# the H100's decode step: 1.338 ms/token in 2048-wide steps vs 1.367 in 4096-wide, 2026-12-07).
DECODE_ELEMENTS = 8192
DECODE_MAX_K = 4096
DECODE_STEP_K = 2048


def _decode_block_k(k: int) -> int:
    """BLOCK_K for an M=1 row of K > 1024: one step where it can be (K's power of two, masked
    where K fills at least 3/4 of it; or a power of two plus whole pieces), else DECODE_STEP_K."""
    full = triton.next_power_of_2(k)
    if full <= DECODE_MAX_K and 4 * k >= 3 * full:
        return full
    below = full // 2
    return below if below <= DECODE_MAX_K and k_pieces(k, below)[0] else DECODE_STEP_K


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """A reasonable config for a shape the table does not list."""
    if m <= GEMV_MAX_M:
        block_n = 4 if n <= 2048 else 8 if n <= 16384 else 16
        # the per-step product is [rows, BLOCK_N, BLOCK_K]: fewer K per step for more rows
        widest = 1024 if k <= 1024 else 512
        if backend.is_interpreter():
            # CPU sizes (K <= 160) still walk several chunks, or split; N > 4 still takes several
            # programs, but at most 4: the interpreter's cost is per program (~50 ms each), not per
            # element (the embedded model's e2e run: 68 s with up to 16 programs, 28 s with 4).
            widest = 64
            block_n = max(block_n, triton.next_power_of_2(triton.cdiv(n, 4)))
        elif m == 1 and k > 1024:
            block_k = _decode_block_k(k)
            plain = gemv_config(min(block_n, DECODE_ELEMENTS // block_k), block_k, 1, 4, 1)
            if triton.cdiv(n, plain.block_n) >= SMS:  # else the pipelined loop below, split to fill the GPU
                return plain
        block_k = widest // triton.next_power_of_2(max(m, 1))
        stages = 1 if k <= block_k else 3  # one K step: nothing to pipeline, plain wide loads
        return gemv_config(block_n, block_k, _fill_split(triton.cdiv(n, block_n), k, block_k), 4, stages)
    if m <= 64:  # skinny: a 16..64-row tile, split K to fill the GPU
        block_m = max(16, triton.next_power_of_2(m))
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
        return tiled_config(block_m, 64, 128, _fill_split(tiles, k, 128), 4, 4)
    if triton.cdiv(m, 128) * triton.cdiv(n, 128) >= SMS:
        return tiled_config(128, 128, 64, 1, 8, 3)
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 64)
    return tiled_config(64, 64, 64, _fill_split(tiles, k, 64), 4, 4)


def config_for(m: int, n: int, k: int) -> GemmConfig:
    """The table's config for ``(m_bucket(m), n, k)``, else :func:`default_config`."""
    return CONFIGS.get((m_bucket(m), n, k)) or default_config(m, n, k)


def table_config(m: int, n: int, k: int) -> GemmConfig:
    """What ``linear`` launches for this shape: :func:`config_for`, split no finer than K's blocks."""
    config = config_for(m, n, k)
    split = min(config.split_k, max(1, triton.cdiv(k, config.block_k)))
    return config if split == config.split_k else config.replace(split_k=split)


def partials_shape(m: int, n: int, k: int) -> tuple[int, int, int] | None:
    """The fp32 partials buffer ``linear`` needs for this shape (None: its config does not split K).

    A caller may allocate it and pass it as ``partials=``; otherwise ``linear`` uses its workspace.
    """
    split = table_config(m, n, k).split_k
    return (split, m, n) if split > 1 else None
