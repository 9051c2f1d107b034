"""Every kernel compiles for the H200 (sm_90, PDL on) without a GPU (``scripts/compile_sm90.py``):
the interpreter never compiles, so codegen-only breakage (a PDL branch, a bad constexpr, lost
alignment) is caught here, in CI, and not first on the GPU. The script also fails a kernel whose
PTX touches global memory before ``griddepcontrol.wait`` (a load planted above the wait in
``_rms_norm_kernel`` was caught so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_pdl import KERNELS

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_compiles_for_sm90_and_decode_gemvs_stream_16_bytes_evict_first(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONCHECK_BACKEND")}
    out = tmp_path / "launches.json"
    run = subprocess.run(
        [sys.executable, "scripts/compile_sm90.py", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    launches = json.loads(out.read_text())
    compiled = {entry["kernel"].rsplit(".", 1)[1] for entry in launches}
    defined = {name.split(":")[1] for name, _ in KERNELS}
    assert defined <= compiled, f"never launched, so never compiled: {sorted(defined - compiled)}"
    presets = ("article decode", "qwen3-0.6b decode", "qwen2.5-0.5b decode")
    # and default_config's guesses for an unlisted model's decode shapes, held to the same rules
    decode_labels = (*presets, "guessed decode")
    in_decode = [e for e in launches if any(label.startswith(decode_labels) for label in e["launches"])]
    decode = [e for e in in_decode if "_gemv" in e["kernel"]]
    assert len(decode) >= 12
    early = {label for e in decode if e["constexprs"]["EARLY_WEIGHT"] for label in e["launches"]}
    # the model's one-step static-weight gemvs request their weight before the PDL wait (ops/gemm.py
    # linear): o_proj, and down_proj (Qwen3's K = 3072 in one masked step, 4864 in whole pieces)
    one_step = {f"{preset} {point}" for preset in presets for point in ("o_proj", "down_proj")}
    assert one_step <= early, early
    for entry in decode:  # the weight stream in 16-byte loads or cp.async copies, never 2-byte ones
        narrow = sum(count for op, count in entry["loads"].items() if op.endswith(".b16"))
        bias = entry["constexprs"]["BLOCK_N"] if entry["constexprs"]["HAS_BIAS"] else 0
        assert narrow <= bias, entry  # a bias of BLOCK_N elements is all a 2-byte load may fetch
        assert entry["spill_bytes"] == 0, entry  # registers are printed; spills are never right here
        # the weight streamed evict_first, so the step's 1.3 GB of weights leave the KV cache and
        # activations in L2 for the next step; a pipelined loop's cp.async copies would drop the hint
        assert any("L2::cache_hint" in op for op in entry["loads"]), entry
        assert not any(op.startswith("cp.async") for op in entry["loads"]), entry
        if entry["constexprs"]["ONE_STEP"] and entry["constexprs"]["BLOCK_M"] == 1:
            # no layout change through shared memory before the reduction: a [1, BLOCK_N, BLOCK_K]
            # tile took 2-4 KB and cost the article decode step 0.023 ms/token (ops/gemm.py). K in
            # whole pieces adds the pieces' sums, each in its tile's layout, through shared memory:
            # 2 KB at down's n2 k4096 w4 (the step measured with that: 0.652 vs 0.660 ms/token)
            pieces = entry["constexprs"]["PIECE1"] > 0
            assert entry["shared_bytes"] <= (2048 if pieces else 512), entry
