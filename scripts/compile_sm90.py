"""Compile every kernel the ops launch for the H200 (sm_90, PDL on), on a machine without a GPU.

The interpreter never compiles a kernel, and the ``PDL`` branches compile away there, so a
kernel that only breaks in codegen would otherwise first fail on the GPU. This runs each
registered op's typical case, every model preset's decode projections as the model launches
them, the article's 256-token prefill projections and its attention over 4096- and 32768-row
caches, with the kernels swapped for recorders (nothing executes); specializes each launch's arguments as
Triton's JIT would (``1`` and multiples of 16, 16-byte aligned pointers, ``do_not_specialize``
honoured); compiles it to PTX; and reports per launch its registers and spills (ptxas), shared
memory, how many of its programs an SM holds and so in how many waves its grid runs (a partial
last wave idles SMs), its CTA barriers (``bar.sync``: each a cross-warp reduction or a layout
change through shared memory; a 3-D gemv tile's layout change cost the article decode step
0.023 ms/token), and its global-load instruction mix: 2-byte loads of a decode GEMM's
weights mean its stream lost its 16-byte vectors. A launch fails when it does not compile, or
when its PTX touches global memory before ``griddepcontrol.wait``: the PDL contract of
``ops/pdl.py`` (tests/test_pdl.py checks the source; this checks what the compiler made of it),
where only a launch with ``EARLY_WEIGHT`` may load (its weight chunk) there, or when the
attention decode split kernel has no L2 prefetch there.

Usage: python scripts/compile_sm90.py [--json PATH]   (exit 1 when a launch fails)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton._utils import find_paths_if, get_iterable_path
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
TARGET = GPUTarget("cuda", 90, 32)
SMS = 132  # the H200's
BARRIERS = re.compile(r"\bbar\.sync\b")
HINT = ".L1::evict_first.L2::cache_hint"  # tl.load(..., eviction_policy="evict_first") in the PTX
LOADS = re.compile(r"\b(?:ld\.global[\w.:]*|cp\.async\.c[ag]\.shared\.global)")
# the first instruction that touches global memory (a predicate may guard it)
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async\.c[ag]|atom\.|red\.)", re.M)


class Recorder:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles the launch instead of running it."""

    def __init__(self, module: str, name: str, kernel: triton.runtime.JITFunction, results: dict) -> None:
        self.module, self.name, self.kernel, self.results = module, name, kernel, results
        self.label, self.grid = "", (1,)

    def __getitem__(self, grid: tuple[int, ...]):
        self.grid = grid
        return self.launch

    def launch(self, *args: object, **kwargs: object) -> None:
        k = self.kernel
        bound = dict(zip(k.arg_names, args, strict=False)) | {
            n: v for n, v in kwargs.items() if n in k.arg_names
        }
        # as triton.runtime.jit's _pack_args: tuple arguments nest, so constexprs and attributes
        # are keyed by paths into the argument list
        values, kinds, keys = [], [], []
        for param in k.params:
            value = bound.get(param.name, param.default)
            values.append(value)
            if param.is_constexpr:
                kinds.append("constexpr")
                keys.append(value)
                continue
            specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
            kind, key = native_specialize_impl(BaseBackend, value, False, specialize, align)
            kinds.append(kind)
            keys.append(key)
        signature = {param.name: kind for param, kind in zip(k.params, kinds, strict=True)}
        constexpr_paths = find_paths_if(kinds, lambda _, v: v == "constexpr")
        constexprs = {path: get_iterable_path(values, path) for path in constexpr_paths}
        attrs = {path: [["tt.divisibility", 16]] for path in find_paths_if(keys, lambda _, v: v == "D")}
        options = {n: kwargs[n] for n in ("num_warps", "num_stages") if n in kwargs}
        key = repr((self.name, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs), options))
        if key in self.results:
            self.results[key]["launches"][self.label] = math.prod(self.grid)
            return
        declared = {i for i, p in enumerate(k.params) if p.is_constexpr}
        entry = {
            "kernel": f"{self.module}.{self.name}",
            "launches": {self.label: math.prod(self.grid)},  # what launched it: its program count
            "constexprs": {k.arg_names[path[0]]: v for path, v in constexprs.items() if path[0] in declared},
        }
        try:
            source = ASTSource(fn=k, signature=signature, constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(source, target=TARGET, options={**options, "launch_pdl": True})
            ptx = compiled.asm["ptx"]
            entry["loads"] = dict(collections.Counter(LOADS.findall(ptx)))
            entry["registers"], entry["spill_bytes"] = _register_use(ptx)
            entry["shared_bytes"] = compiled.metadata.shared
            entry["barriers"] = len(BARRIERS.findall(ptx))
            threads = 32 * compiled.metadata.num_warps
            entry["programs_per_sm"] = _programs_per_sm(entry["registers"], threads, entry["shared_bytes"])
            wait = ptx.find("griddepcontrol.wait")
            early = [m.group(1) for m in MEMORY.finditer(ptx, 0, max(wait, 0))]
            if entry["constexprs"].get("EARLY_WEIGHT"):  # the weight chunk's loads only
                early = [op for op in early if op != "ld.global"]
            if wait < 0 or early:
                entry["error"] = "PDL: global memory is touched before griddepcontrol.wait in the PTX"
            elif self.name == "_decode_split_kernel" and "prefetch.global.L2" not in ptx[:wait]:
                entry["error"] = "no L2 prefetch (prefetch.global.L2) before griddepcontrol.wait in the PTX"
        except Exception as error:  # reported per launch; the run goes on
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        self.results[key] = entry


def _register_use(ptx: str) -> tuple[int, int]:
    """Registers per thread and bytes spilled (stores), as ptxas reports them for sm_90a: what
    bounds how many programs an SM holds, and so the bytes a GEMV keeps in flight."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run(
            [knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if registers is None or spills is None:  # a changed report format must not read as "no spills"
        raise RuntimeError(f"ptxas -v: no register or spill line in {report.strip()[:200]!r}")
    return int(registers.group(1)), int(spills.group(1))


def _programs_per_sm(registers: int, threads: int, shared: int) -> int:
    """How many programs of a kernel one Hopper SM holds: 2048 threads, 64K registers (allocated
    per thread in steps of 8), 228 KB of shared memory (1 KB reserved per program), 32 programs."""
    by_registers = 65536 // (-(-max(registers, 1) // 8) * 8 * threads)
    by_shared = (228 * 1024) // (shared + 1024)
    return max(0, min(2048 // threads, by_registers, by_shared, 32))


def install_recorders(results: dict) -> list[Recorder]:
    """Import the ops as the GPU build (CUDA backend, PDL on, the H200's 132 SMs) taking CPU
    tensors, and swap every ``*_kernel`` for a recorder."""
    os.environ["TRITONCHECK_BACKEND"] = "cuda"
    torch.cuda.is_available = lambda: True  # only the choice of backend asks; nothing launches
    backend = importlib.import_module("ops.backend")
    backend.device = lambda: torch.device("cpu")
    importlib.import_module("ops.pdl").enabled = lambda: True
    importlib.import_module("ops.attention")._sm_count = lambda: 132
    importlib.import_module("registry")  # imports every op module
    recorders = []
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("ops.") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if name.endswith("_kernel") and isinstance(value, triton.runtime.JITFunction):
                recorder = Recorder(module_name, name, value, results)
                setattr(module, name, recorder)
                recorders.append(recorder)
    return recorders


# Qwen2.5-1.5B's shape (hidden 1536, heads 12/2 x 128, intermediate 8960, QKV bias): the config
# table lists none of its projections, so its decode launches default_config's guesses
GUESSED = "guessed"


def _guessed_model(presets: dict):
    return dataclasses.replace(
        presets["qwen2.5-0.5b"], hidden_size=1536, num_heads=12, head_dim=128, intermediate_size=8960
    )


def decode_launches(cfg, preset: str, label) -> None:
    """Every decode GEMM of one model config, launched as the model launches it."""
    from model.decoder import STATIC_WEIGHT_POINTS
    from ops import fused_linear, gemm
    from verify.strategies.gemm import config_projections

    for proj in config_projections(cfg):
        n, k = proj.n, proj.k
        label(f"{preset} decode {proj.name}")
        x, w = torch.empty(1, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
        bias = torch.empty(n, dtype=torch.bfloat16) if proj.bias else None
        norm = torch.empty(k, dtype=x.dtype)
        if proj.name == "qkv_proj":  # residual add + RMSNorm in the prologue
            fused_linear.add_rms_norm_linear(x, torch.empty_like(x), norm, 1e-6, w, bias)
            if not cfg.qk_norm:  # and RoPE + the cache write in the epilogue
                label(f"{preset} decode {proj.name} + rope_kv_store")
                cache = torch.empty(1, 4096, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
                cos = torch.empty(1, 1, cfg.head_dim // 2)
                start = torch.zeros(1, dtype=torch.int32)
                fused_linear.add_rms_norm_linear_rope_kv_store(
                    x,
                    torch.empty_like(x),
                    norm,
                    1e-6,
                    w,
                    bias,
                    cos,
                    cos,
                    cache,
                    torch.empty_like(cache),
                    start,
                )
                label(f"{preset} decode {proj.name}")
        if proj.name == "gate_up_proj":  # and the SwiGLU gate in the epilogue
            fused_linear.add_rms_norm_linear_silu_mul(x, torch.empty_like(x), norm, 1e-6, w)
        if proj.name != "gate_up_proj":  # plain; o, down and lm_head on the model's static weights
            gemm.linear(x, w, bias, static_weight=proj.name in STATIC_WEIGHT_POINTS)


def run_ops(recorders: list[Recorder]) -> None:
    import registry
    from model.config import PRESETS
    from ops import attention, gemm
    from verify.strategies.gemm import config_projections

    def label(text: str) -> None:
        for r in recorders:
            r.label = text

    for spec in registry.all():
        label(f"{spec.name} (typical case)")
        case = spec.build(spec.typical, torch.device("cpu"))
        spec.impl(*case.args, **case.kwargs)
    for preset, cfg in {**PRESETS, GUESSED: _guessed_model(PRESETS)}.items():
        decode_launches(cfg, preset, label)
        if preset == "article":
            for proj in config_projections(cfg):
                label(f"article prefill {proj.name}")
                w = torch.empty(proj.n, proj.k, dtype=torch.bfloat16)
                bias = torch.empty(proj.n, dtype=torch.bfloat16) if proj.bias else None
                gemm.linear(torch.empty(256, proj.k, dtype=torch.bfloat16), w, bias)
    cache = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16)
    for tokens in (1, 256):  # decode over a cache long enough to be split (the combine runs); prefill
        label(f"article {'decode' if tokens == 1 else 'prefill'} attention, cache 4096")
        q = torch.empty(1, tokens, 8, 128, dtype=torch.bfloat16)
        attention.attention(q, cache, cache, torch.full((1,), 4096, dtype=torch.int32), 128**-0.5)
    # a long cache: splits of several tiles shared out by length, more splits than a combine chunk
    label("article decode attention, cache 32768")
    cache = torch.empty(1, 32768, 2, 128, dtype=torch.bfloat16)
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    attention.attention(q, cache, cache, torch.full((1,), 1024, dtype=torch.int32), 128**-0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/compile_sm90.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from verify import cli  # imports no op: the backend is chosen in install_recorders

    cli.require_output_file(p, "--json", args.json)  # before minutes of compiling
    results: dict = {}
    run_ops(install_recorders(results))
    rows = sorted(results.values(), key=lambda e: e["kernel"])
    print(f"{'kernel':38} {'launched for':40} regs spill smem/KB bars per-SM programs waves  global loads")
    for entry in rows:
        for label, programs in entry["launches"].items():
            if "error" in entry:
                print(f"{entry['kernel']:38} {label[:40]:40} {entry['error']}")
                continue
            per_sm = entry["programs_per_sm"]
            waves = programs / (per_sm * SMS) if per_sm else float("inf")
            # the JSON keeps the PTX's own spelling of a hinted load (the L1 and L2 policies)
            mix = sorted(entry["loads"].items())
            loads = " ".join(f"{n.replace(HINT, '.L2::evict_first')}:{c}" for n, c in mix)
            print(
                f"{entry['kernel']:38} {label[:40]:40} {entry['registers']:4} {entry['spill_bytes']:5} "
                f"{entry['shared_bytes'] / 1024:7.1f} {entry['barriers']:4} {per_sm:6} {programs:8} "
                f"{waves:5.2f}  {loads}"
            )
    failed = [e for e in rows if "error" in e]
    ok = len(rows) - len(failed)
    print(f"\n{len(rows)} distinct launches: {ok} compiled for sm_90, {len(failed)} failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
