#!/usr/bin/env bash
# Everything the GPU must confirm, in one device call (device time is scarce): the test suite
# on compiled kernels (gpu profile, full-size named shapes), token parity and bisect on the
# article preset, then the model benchmark. Logs go to $OUT (default ./out).
# Usage: scripts/gpu_verify.sh [stage ...]   (--help lists the stages)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITONCHECK_CACHE=${TRITONCHECK_CACHE:-/tmp/tritoncheck}
STAGES="tests e2e bisect bench ops gemm gemm-decode sweep-decode thorough attention ab config"
USAGE="usage: scripts/gpu_verify.sh [stage ...]; stages: $STAGES"
stages=${*:-tests e2e bisect bench}
case " $* " in *" -h "* | *" --help "*) echo "$USAGE"; exit 0 ;; esac
for stage in $stages; do  # every name (and what ab needs) checked before any stage runs
    case " $STAGES " in
        *" $stage "*) ;;
        *) echo "$USAGE (unknown: $stage)" >&2; exit 2 ;;
    esac
    if [ "$stage" = ab ] && ! ls -d ab_*/ >/dev/null 2>&1; then
        echo "ab: no ab_*/ copies (git archive REV | tar -x -C ab_base)" >&2; exit 2
    fi
    if [ "$stage" = config ] && [ ! -e "${BENCH_CONFIG:-}" ]; then
        echo "config: BENCH_CONFIG must name a model's config.json or checkpoint directory" >&2; exit 2
    fi
done
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the ab stage runs from ab_base/

run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, one summary line per stage
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    # the log's last line too (pytest's counts, e2e's verdict): the summary reads alone where
    # the logs do not all come back
    echo "$name: rc $rc in $((SECONDS - began)) s: $(tail -n 1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
for stage in $stages; do
    case $stage in
        # the kernel-running tests; the CPU-only ones (interpreter patch, CLI subprocesses, HF
        # oracle in fp32, building the embedded checkpoint) add nothing on the GPU, but for the
        # injected op that faults the GPU inside verify.e2e and verify.bisect. A fresh machine
        # compiles every kernel, and that varies: 204-248 s, 322 s once, and once past 330 s
        tests) run tests 480 python -m pytest -n 16 -q -p no:cacheprovider --durations=12 tests/test_ops.py tests/test_compare.py \
            tests/test_model.py tests/test_gemm.py tests/test_attention.py tests/test_fused_linear.py \
            tests/test_rope_kv_store.py tests/test_strategy_reach.py tests/test_rounding.py tests/test_embedding.py tests/test_aliasing.py \
            tests/test_gpu_faults.py tests/test_tools.py::test_an_injected_kernel_reading_far_outside_x_is_a_divergence ;;
        # and again over the article's whole 32768-row context (a server's cache): decode attention
        # then shares a short sequence out over many splits and combines only the busy ones
        e2e) run e2e 60 python -m verify.e2e --model article --new-tokens 16 --json "$OUT/e2e.json"
            run e2e-long-cache 60 python -m verify.e2e --model article --new-tokens 16 --cache-len 32768 \
                --against reference --json "$OUT/e2e-long-cache.json" ;;
        bisect) run bisect 70 python -m verify.bisect --layer --model article --json "$OUT/bisect.json" \
            --plot "$OUT/bisect.png" ;;
        # every registered op through verify.op, gpu profile, ending with its one-table summary;
        # 124-192 s after `tests` has filled the kernel cache, but on a fresh machine it compiles
        # every variant itself, one process: 311 s for all 19 ops on a fresh H100 (2026-12-07)
        ops) run ops 540 python -m verify.op --all --json "$OUT/ops.json" ;;
        bench) run bench 300 python -m verify.bench model --preset article --skip eager,reference --profile \
            --json "$OUT/model.json" ;;
        gemm) run gemm 200 python -m verify.bench gemm --preset all --json "$OUT/gemm.json" ;;
        gemm-decode) run gemm-decode 100 python -m verify.bench gemm --preset article --phase decode \
            --json "$OUT/gemm-decode.json" ;;
        sweep-decode) run sweep-decode 200 python -m verify.bench gemm --sweep --preset all --phase decode \
            --json "$OUT/sweep-decode.json" ;;
        # 500 drawn cases per op (each op is one test: -n spreads the ops, not the cases); -x so
        # the first failure is printed in full before any time limit cuts the log.
        # THOROUGH_OPS='a or b' narrows it to those ops.
        thorough) run thorough 440 env HYPOTHESIS_PROFILE=thorough python -m pytest -n 16 -x -v -p no:cacheprovider \
            tests/test_ops.py -k "test_matches_reference${THOROUGH_OPS:+ and ($THOROUGH_OPS)}" ;;
        attention) run attention 150 python -m verify.bench attention --json "$OUT/attention.json" ;;
        # the decode step of this tree against each ab_*/ copy (ab_base/: an earlier commit, git
        # archive REV | tar -x -C ab_base; ab_<variant>/: this tree with one change), alternating
        # in one call, two rounds: the same code's step varies more across calls than most changes
        # move it. The copies are git-ignored, so the device call must carry them.
        # AB_PRESET picks the model (default article; qwen2.5-0.5b has the QKV bias, qwen3-0.6b qk-norm);
        # AB_ARGS adds benchmark options to every run, e.g. '--prompt-len 4000 --new-tokens 64' (a long cache).
        ab)
            copies=$(ls -d ab_*/)
            for round in 1 2; do
                for copy in $copies; do
                    (cd "$copy" && run "ab-${copy%/}-$round" 120 env PYTHONPATH="$PWD" python -m verify.bench model \
                        --preset "${AB_PRESET:-article}" --skip unfused,eager,reference,compile,hf --repeat 3 ${AB_ARGS:-})
                done
                run "ab-current-$round" 120 python -m verify.bench model --preset "${AB_PRESET:-article}" \
                    --skip unfused,eager,reference,compile,hf --repeat 3 --profile ${AB_ARGS:-}
            done
            for log in "$OUT"/ab-*.log; do
                echo "$(basename "$log" .log): $(grep '^triton + CUDA graph ' "$log")"
            done | tee -a "$OUT/summary.txt" ;;
        # the three benchmarks on another model's shape ($BENCH_CONFIG: its config.json or
        # checkpoint directory; random weights of that shape): which GEMM configs the table lacks
        # and how default_config's guesses for them do, its decode step, its attention layout
        config)
            run config-gemm 200 python -m verify.bench gemm --config "$BENCH_CONFIG" --json "$OUT/config-gemm.json"
            run config-model 300 python -m verify.bench model --config "$BENCH_CONFIG" --skip eager,reference \
                --profile --json "$OUT/config-model.json"
            run config-attention 150 python -m verify.bench attention --config "$BENCH_CONFIG" \
                --json "$OUT/config-attention.json" ;;
        *) echo "$USAGE (no rule for: $stage)" >&2; exit 2 ;;
    esac
done
