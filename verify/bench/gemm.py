"""``python -m verify.bench gemm``: our GEMM kernels against cuBLAS on every projection of a model.

Normal mode: each projection at decode (M=1) and prefill (M=256), three rows: the config the
table picks (marked ``*``; what ``linear`` runs), the same config with split-K flipped (off if
the table splits K, on otherwise), and ``torch.nn.functional.linear`` (cuBLAS). Decode is
judged against the weight-read roofline (measured kernel-copy bandwidth), prefill against the
measured dense bf16 matmul peak and cuBLAS.

``--sweep``: times a compact list of candidate configs per shape and prints the fastest as a
ready-to-paste ``CONFIGS`` table for ``ops/gemm_config.py``.

Every config is checked against a torch fp32 matmul before it is timed, so a fast but wrong
config cannot win. Everything is timed the way the model runs: many launches captured back to
back in one CUDA Graph, each on its own copy of the weight, copies rotating through more than
3x the L2 (``verify.bench.timing``). Exit 0: every timed config computed the right answer;
1: some config did not (its row says ``WRONG``); 2: bad usage.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from model.decoder import STATIC_WEIGHT_POINTS
from ops import gemm, gemm_config
from ops.gemm_config import GemmConfig, gemv_config, tiled_config
from verify import cli
from verify.bench import timing
from verify.strategies.gemm import MODEL_PROJECTIONS, Projection, config_projections

PHASES = ((1, "decode"), (256, "prefill"))
DECODE_BW_TARGET = 0.75  # M=1: >= 75% of the copy bandwidth on the weight bytes ...
LM_HEAD_BOUND_RATIO = 1.2  # ... lm_head within 1.2x of the bandwidth-bound time
PREFILL_CUBLAS_TARGET = 0.70  # M=256: >= 70% of cuBLAS's speed


# ---- candidates for the sweep ------------------------------------------------------------------


# Decode: how many outputs a program owns (BLOCK_N), how much of K one step loads, how far K is
# split, and whether the K loop is pipelined through shared memory (num_stages > 1) or loads
# straight into registers (1); plus skinny tl.dot tiles with split-K. Kept short: each config
# compiles once per shape class.
DECODE_CANDIDATES = (
    gemv_config(2, 1024, 1, 2, 1),
    gemv_config(4, 1024, 1, 4, 1),
    gemv_config(4, 1024, 1, 4, 2),
    gemv_config(8, 1024, 1, 4, 1),
    gemv_config(8, 1024, 1, 8, 1),
    gemv_config(16, 1024, 1, 8, 1),
    gemv_config(16, 512, 1, 4, 3),
    gemv_config(32, 256, 1, 4, 4),
    gemv_config(8, 512, 1, 4, 4),
    gemv_config(4, 1024, 2, 4, 2),
    gemv_config(4, 512, 2, 4, 1),
    gemv_config(4, 512, 4, 4, 1),
    gemv_config(8, 512, 4, 4, 3),
    gemv_config(4, 256, 8, 4, 3),
    # K steps that divide the models' K (4864 = 19 x 256) so no step is masked, deeper pipelines
    gemv_config(2, 512, 1, 4, 4),
    gemv_config(4, 512, 1, 4, 4),
    gemv_config(4, 256, 1, 4, 4),
    gemv_config(8, 256, 1, 4, 4),
    gemv_config(16, 256, 1, 8, 4),
    gemv_config(8, 1024, 1, 8, 2),
    tiled_config(16, 64, 128, 4, 4, 4),
    tiled_config(16, 32, 256, 8, 4, 3),
)
# Prefill (M=256): tl.dot tiles; split-K variants for the small-N, long-K projections.
PREFILL_CANDIDATES = (
    tiled_config(128, 256, 64, 1, 8, 3),
    tiled_config(128, 128, 64, 1, 8, 3),
    tiled_config(128, 128, 64, 1, 4, 4),
    tiled_config(128, 64, 64, 1, 4, 4),
    tiled_config(64, 128, 64, 1, 4, 4),
    tiled_config(64, 64, 64, 1, 4, 4),
    tiled_config(64, 64, 128, 1, 4, 3),
    tiled_config(128, 128, 64, 2, 8, 3),
    tiled_config(64, 128, 64, 2, 4, 4),
    tiled_config(64, 64, 64, 2, 4, 4),
    tiled_config(64, 64, 64, 4, 4, 4),
)


# ---- one problem: inputs, weight copies, fp32 answer ------------------------------------------


@dataclass
class Problem:
    preset: str
    proj: Projection
    m: int
    x: torch.Tensor
    weights: list[torch.Tensor]
    bias: torch.Tensor | None
    ref: torch.Tensor  # fp32 x @ weights[0].T + bias

    @property
    def label(self) -> str:
        return f"{self.proj.name} {self.proj.n}x{self.proj.k}{' +bias' if self.proj.bias else ''}"

    @property
    def weight_bytes(self) -> int:
        return self.proj.n * self.proj.k * 2

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + 2 * self.m * (self.proj.k + self.proj.n)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.proj.n * self.proj.k


def make_problem(preset: str, proj: Projection, m: int, device: str = "cuda", copies: int = 0) -> Problem:
    """Inputs and ``copies`` (default: enough to rotate through 3x the L2) copies of one weight."""
    gen = torch.Generator(device=device).manual_seed(0)
    n, k = proj.n, proj.k
    w0 = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    # Same values, separate memory: each captured launch streams its own copy from HBM.
    weights = [w0] + [w0.clone() for _ in range((copies or timing.copies_for(n * k * 2)) - 1)]
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    bias = (0.1 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16) if proj.bias else None
    ref = x.float() @ w0.float().T
    if bias is not None:
        ref += bias.float()
    return Problem(preset, proj, m, x, weights, bias, ref)


def check_output(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Right up to rounding: at most 2x the error of rounding the fp32 answer once, plus fp32 noise."""
    err = (y.float() - ref).abs().max().item()
    rounding = (ref.to(y.dtype).float() - ref).abs().max().item()
    return err <= 2 * rounding + 1e-5 * ref.abs().max().item(), err


def ours(problem: Problem, config: GemmConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """``w -> launch(...)`` on buffers allocated once, as the CUDA Graph runner does, with the
    weight declared static where the model declares it."""
    m, n, device = problem.m, problem.proj.n, problem.x.device
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    partials = None
    if config.split_k > 1:
        partials = torch.empty(config.split_k, m, n, device=device, dtype=torch.float32)
    static = problem.proj.name in STATIC_WEIGHT_POINTS
    return lambda w: gemm.launch(
        problem.x, w, problem.bias, config, out=out, partials=partials, static_weight=static
    )


def cublas(problem: Problem) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: F.linear(problem.x, w, problem.bias)


def time_per_call(problem: Problem, fn: Callable[[torch.Tensor], torch.Tensor], replays: int) -> float:
    calls = [(lambda w=w: fn(w)) for w in problem.weights]
    return timing.graph_time_per_call(calls, replays=replays)


@dataclass
class Row:
    preset: str
    shape: str
    m: int
    n: int
    k: int
    impl: str
    config: str
    seconds: float | None
    correct: bool
    max_error: float
    gbps: float = 0.0
    tflops: float = 0.0
    pct_roofline: float = 0.0
    vs_cublas: float = 0.0  # cuBLAS time / this time: > 1 is faster than cuBLAS
    note: str = ""


@dataclass
class Roofline:
    copy_bw: float  # bytes/s
    bf16_peak: float  # FLOP/s
    launch_s: float  # an empty kernel's time in a chain of dependent launches (the timing's setup)

    def percent(self, problem: Problem, seconds: float) -> float:
        if problem.m == 1:  # bandwidth bound: the weight read at copy bandwidth
            return 100 * problem.weight_bytes / self.copy_bw / seconds
        return 100 * problem.flops / seconds / self.bf16_peak


def measure(
    problem: Problem,
    impl: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    config_text: str,
    roof: Roofline,
    replays: int,
    gate: bool = True,
) -> Row:
    """Check ``fn`` against the fp32 answer, then (if right, or ``gate`` is off: cuBLAS) time it."""
    proj = problem.proj
    row = Row(problem.preset, problem.label, problem.m, proj.n, proj.k, impl, config_text, None, False, 0.0)
    try:
        y = fn(problem.weights[0])
        torch.cuda.synchronize()
        row.correct, row.max_error = check_output(y, problem.ref)
        if not row.correct and gate:
            row.note = "WRONG: not timed"
            return row
        if not row.correct:
            row.note = f"max error {row.max_error:.3g} (baseline, timed anyway)"
        row.seconds = time_per_call(problem, fn, replays)
    except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
        row.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        return row
    row.gbps = problem.bytes_moved / row.seconds / 1e9
    row.tflops = problem.flops / row.seconds / 1e12
    row.pct_roofline = roof.percent(problem, row.seconds)
    return row


# ---- normal mode -------------------------------------------------------------------------------


def _flipped(config: GemmConfig, n: int) -> tuple[str, GemmConfig]:
    if config.split_k > 1:
        return "ours, no split-K", config.replace(split_k=1)
    split = 4 if n <= 2048 else 2
    return f"ours, split-K {split}", config.replace(split_k=split)


def bench_problem(problem: Problem, roof: Roofline, replays: int) -> list[Row]:
    m, n, k = problem.m, problem.proj.n, problem.proj.k
    table = gemm_config.table_config(m, n, k)
    source = "table" if (gemm_config.m_bucket(m), n, k) in gemm_config.CONFIGS else "default"
    alt_name, alt = _flipped(table, n)
    rows = [
        measure(problem, "ours *", ours(problem, table), f"{table.describe()} ({source})", roof, replays),
        measure(problem, alt_name, ours(problem, alt), alt.describe(), roof, replays),
        measure(problem, "cuBLAS", cublas(problem), "F.linear", roof, replays, gate=False),
    ]
    base = rows[-1].seconds
    for row in rows:
        if row.seconds and base:
            row.vs_cublas = base / row.seconds
    return rows


def targets(rows: list[Row], roof: Roofline) -> list[str]:
    """One line per (projection, phase): the brief's performance target for the table's pick, met or not."""
    lines = []
    for pick in rows[::3]:  # bench_problem gives three rows per problem, the table's pick first
        name = f"{pick.preset} {pick.shape} M={pick.m}"
        if not pick.seconds:
            lines.append(f"MISS {name}: not timed ({pick.note})")
            continue
        if pick.m == 1:  # every projection: the bandwidth share and cuBLAS; lm_head a tighter share
            need = 100 / LM_HEAD_BOUND_RATIO if "lm_head" in pick.shape else 100 * DECODE_BW_TARGET
            ok = pick.pct_roofline >= need and pick.vs_cublas >= 1.0
            want = f">= {need:.0f}% of copy bandwidth and no slower than cuBLAS"
            got = f"{pick.pct_roofline:.0f}% of bandwidth, {pick.vs_cublas:.2f}x cuBLAS speed"
            # timed as a chain of launches, none faster than an empty kernel's
            ceiling = min(100.0, 100 * 2 * pick.n * pick.k / roof.copy_bw / roof.launch_s)
            if ceiling < need:
                got += f" (at most {ceiling:.0f}% here: the weight read is shorter than an empty launch)"
        else:
            ok = pick.vs_cublas >= PREFILL_CUBLAS_TARGET
            want = f">= {100 * PREFILL_CUBLAS_TARGET:.0f}% of cuBLAS speed"
            got = f"{100 * pick.vs_cublas:.0f}% of cuBLAS speed ({pick.pct_roofline:.0f}% of bf16 peak)"
        lines.append(f"{'ok  ' if ok else 'MISS'} {name}: {got}; target {want}")
    return lines


def _fmt(rows: Iterable[Row]) -> str:
    body = []
    for r in rows:
        timed = r.seconds is not None
        body.append(
            [
                r.shape,
                r.m,
                r.impl,
                r.config,
                f"{r.seconds * 1e6:.2f}" if timed else "-",
                f"{r.gbps:.0f}" if timed else "-",
                f"{r.tflops:.1f}" if timed else "-",
                f"{r.pct_roofline:.0f}%" if timed else "-",
                f"{r.vs_cublas:.2f}x" if timed and r.vs_cublas else "-",
                r.note or ("ok" if r.correct else "WRONG"),
            ]
        )
    headers = ["projection", "M", "impl", "config", "us", "GB/s", "TFLOP/s", "% roof", "vs cuBLAS", "check"]
    return timing.table(headers, body)


def _models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, tuple[Projection, ...]]:
    """The projections to time, by model name: the presets chosen, or the ``--config`` model's."""
    if args.config is not None:
        return {args.config: config_projections(cli.shape_config(parser, args.config))}
    names = list(MODEL_PROJECTIONS) if args.preset == "all" else [args.preset]
    return {name: MODEL_PROJECTIONS[name] for name in names}


def _roofline() -> Roofline:
    print("measuring the roofline denominators ...", flush=True)
    launch_s = timing.empty_launch_seconds()
    roof = Roofline(timing.copy_bandwidth(), timing.bf16_matmul_peak(), launch_s)
    print(
        f"  copy bandwidth {roof.copy_bw / 1e12:.2f} TB/s (read + write, kernel copy); "
        f"bf16 dense matmul {roof.bf16_peak / 1e12:.0f} TFLOP/s; "
        f"an empty kernel in a chain of dependent launches {launch_s * 1e6:.2f} us\n"
        "  % roof: M=1 weight bytes at copy bandwidth / time; M=256 achieved / bf16 peak. "
        "vs cuBLAS: cuBLAS time / this time (> 1 is faster)."
    )
    return roof


def run_bench(
    models: dict[str, tuple[Projection, ...]], replays: int, phases: list[int]
) -> tuple[list[Row], list[str], Roofline]:
    roof = _roofline()
    rows: list[Row] = []
    for preset, projections in models.items():
        preset_rows: list[Row] = []
        for proj in projections:
            for m in phases:
                problem = make_problem(preset, proj, m)
                preset_rows += bench_problem(problem, roof, replays)
                del problem
                torch.cuda.empty_cache()
        print(f"\n== {preset} ==")
        print(_fmt(preset_rows), flush=True)
        rows += preset_rows
    lines = targets(rows, roof)
    print("\ntargets (the table's pick, '*'):")
    print("\n".join(f"  {line}" for line in lines))
    return rows, lines, roof


# ---- sweep -------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    m: int
    n: int
    k: int
    shape: str
    best: GemmConfig | None
    best_seconds: float | None
    cublas_seconds: float | None
    rows: list[Row] = field(default_factory=list)


def _unique_problems(
    models: dict[str, tuple[Projection, ...]], phases: list[int]
) -> list[tuple[str, Projection, int]]:
    seen: set[tuple[int, int, int]] = set()
    out = []
    for preset, projections in models.items():
        for proj in projections:
            for m in phases:
                if (m, proj.n, proj.k) not in seen:
                    seen.add((m, proj.n, proj.k))
                    out.append((preset, proj, m))
    return out


def one_step_candidates(k: int) -> list[GemmConfig]:
    """Decode configs that read all of a long K (> 1024) in one step, so that a static weight is
    requested before the PDL wait (``linear``'s ``static_weight``): one masked chunk, and, where
    K is no power of two, whole pieces (``ops.gemm.k_pieces``: 4864 = 4096 + 512 + 256). On the
    H200 (2026-12-01) they took Qwen3's decode step from 0.715 to 0.645 ms/token (o_proj and
    down) and the 4864-wide down from 4.81 to 4.52 us alone."""
    if k <= 1024:  # the fixed candidates' 1024-wide chunks already take such K in one step
        return []
    whole = 1 << (k - 1).bit_length()  # K's next power of two
    configs = [gemv_config(2, whole, 1, w, 1) for w in (4, 8)]
    if whole != k and gemm.k_pieces(k, whole // 2) != (0, 0):
        configs += [gemv_config(n, whole // 2, 1, 4, 1) for n in (1, 2)]
    return configs


def candidates_for(m: int, n: int, k: int) -> list[GemmConfig]:
    """The phase's candidates plus the table's current pick and the default, without duplicates."""
    pool = [gemm_config.config_for(m, n, k), gemm_config.default_config(m, n, k)]
    if m <= gemm_config.GEMV_MAX_M:
        pool += [*DECODE_CANDIDATES, *(one_step_candidates(k) if m == 1 else [])]
    else:
        pool += PREFILL_CANDIDATES
    out: list[GemmConfig] = []
    for config in pool:
        split = min(config.split_k, max(1, -(-k // config.block_k)))
        config = config.replace(split_k=split)
        if config not in out:
            out.append(config)
    return out


def sweep_problem(preset: str, proj: Projection, m: int, roof: Roofline, replays: int) -> SweepResult:
    problem = make_problem(preset, proj, m)
    result = SweepResult(m, proj.n, proj.k, problem.label, None, None, None)
    for config in candidates_for(m, proj.n, proj.k):
        row = measure(problem, "ours", ours(problem, config), config.describe(), roof, replays)
        result.rows.append(row)
        if row.seconds and (result.best_seconds is None or row.seconds < result.best_seconds):
            result.best, result.best_seconds = config, row.seconds
    blas = measure(problem, "cuBLAS", cublas(problem), "F.linear", roof, replays, gate=False)
    result.rows.append(blas)
    result.cublas_seconds = blas.seconds
    for row in result.rows:
        if row.seconds and blas.seconds:
            row.vs_cublas = blas.seconds / row.seconds
    del problem
    torch.cuda.empty_cache()
    return result


def _config_source(config: GemmConfig) -> str:
    """The config as the ``gemv_config(...)`` / ``tiled_config(...)`` call of the table's source."""
    tail = f"{config.block_k}, {config.split_k}, {config.num_warps}, {config.num_stages}"
    if config.kernel == "gemv":
        return f"gemv_config({config.block_n}, {tail})"
    return f"tiled_config({config.block_m}, {config.block_n}, {tail})"


def paste_table(results: list[SweepResult], device: str) -> str:
    lines = [
        f"# Measured by `python -m verify.bench gemm --sweep` on {device}: the fastest correct candidate",
        "# per shape, timed in a CUDA Graph over rotated weight copies (comment: time, cuBLAS time).",
        "CONFIGS: dict[tuple[int, int, int], GemmConfig] = {",
    ]
    for r in results:
        key = f"({r.m}, {r.n}, {r.k})"
        if r.best is None:
            lines.append(f"    # {key}: no correct candidate ran; keep the old entry")
            continue
        blas = f"{r.cublas_seconds * 1e6:.2f} us" if r.cublas_seconds else "-"
        lines.append(
            f"    {key}: {_config_source(r.best)},  # {r.shape.split()[0]} {r.best_seconds * 1e6:.2f} us, "
            f"cuBLAS {blas}"
        )
    lines.append("}")
    return "\n".join(lines)


def run_sweep(
    models: dict[str, tuple[Projection, ...]], replays: int, phases: list[int]
) -> tuple[list[SweepResult], str]:
    roof = _roofline()
    results = []
    for preset, proj, m in _unique_problems(models, phases):
        r = sweep_problem(preset, proj, m, roof, replays)
        results.append(r)
        ranked = sorted((row for row in r.rows if row.seconds), key=lambda row: row.seconds)
        wrong = [row for row in r.rows if not row.seconds]
        current = gemm_config.table_config(m, proj.n, proj.k).describe()
        rank = next((i for i, row in enumerate(ranked) if row.config == current), None)
        where = f"rank {rank + 1}, {ranked[rank].seconds * 1e6:.2f} us" if rank is not None else "not timed"
        print(f"\n{r.shape} M={m}: {len(ranked)} timed, {len(wrong)} not (wrong or failed); ", end="")
        print(f"the current table's {current}: {where}")
        print(_fmt(ranked[:4] + wrong))
        sys.stdout.flush()
    text = paste_table(results, torch.cuda.get_device_name())
    print("\n" + text)
    return results, text


# ---- CLI ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verify.bench gemm",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Exit status: 0 every config ran and matched, 1 one gave a wrong answer or (outside --sweep) "
        "failed to run, 2 bad usage or no CUDA GPU.",
    )
    cli.add_shape_arguments(p, [*MODEL_PROJECTIONS, "all"], "all")
    p.add_argument("--sweep", action="store_true", help="time candidate configs, print the best as a table")
    p.add_argument("--replays", type=cli.positive_int, default=20, help="graph replays per timing (median)")
    p.add_argument("--phase", choices=["decode", "prefill", "all"], default="all", help="M=1, M=256 or both")
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cli.require_output_file(parser, "--json", args.json)
    models = _models(parser, args)
    if timing.cuda_missing("verify.bench gemm"):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 check reference must be fp32
    phases = [m for m, name in PHASES if args.phase in (name, "all")]
    device = torch.cuda.get_device_name()
    what = "presets" if args.config is None else "config"
    print(f"verify.bench gemm on {device}: {what} {', '.join(models)}{' (sweep)' if args.sweep else ''}")
    if args.sweep:
        results, text = run_sweep(models, args.replays, phases)
        rows = [row for r in results for row in r.rows]
        payload: dict = {"device": device, "mode": "sweep", "table": text, "rows": [asdict(r) for r in rows]}
    else:
        rows, lines, roof = run_bench(models, args.replays, phases)
        payload = {
            "device": device,
            "mode": "bench",
            "roofline": asdict(roof),  # the denominators of every row's pct_roofline
            "targets": lines,
            "rows": [asdict(r) for r in rows],
        }
    cli.write_json(args.json, payload)
    # Wrong answers always count; in normal mode so does a config that failed to run (linear
    # would fail the same way), in a sweep a candidate that does not compile is merely skipped.
    bad = [
        r
        for r in rows
        if r.impl != "cuBLAS" and not r.correct and (not args.sweep or not r.note.startswith("failed"))
    ]
    if bad:
        print(f"\n{len(bad)} config(s) gave a wrong answer or failed to run:", file=sys.stderr)
        for r in bad:
            print(
                f"  {r.shape} M={r.m} {r.config}: {r.note or f'max error {r.max_error:.3g}'}", file=sys.stderr
            )
        return 1
    return 0
