#!/usr/bin/env bash
# On one CUDA GPU: the CUDA tests (tests/test_cuda.py: every schedule and the drop-in loops exact on the device),
# then the benchmark at GPU sizes (hidden 1024, 1024 image tokens; benchmarks/cases.py) under bf16 autocast, with the
# allocator's peak per program and the live device in the planner (auto plans against its free memory), and the
# drop-in loops; then the public scripts' loops in bf16 (benchmarks/public_loops.py: FlowGRPO FLUX, DanceGRPO Wan,
# Flow-Factory's pattern) under Retain and auto; then the bf16 equivalence of a FlowGRPO-FLUX-style loop under CUDA
# autocast (benchmarks/bf16_equivalence.py: importance ratios, clipped fraction, gradients served against native).
# Arguments go to the benchmark (e.g. --tunings lora full --loops). Each part has a time limit (TEST_SECONDS,
# BENCH_SECONDS, LOOPS_SECONDS, BF16_SECONDS; by default the four fit in about 13 minutes) so that a slow one still
# leaves the others' results; the tests stop with SIGINT, so pytest still prints the failures it has. Where there is
# no CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu.sh: no CUDA device here (torch.cuda.is_available() is False): skipping the GPU benchmark;" \
         "make bench runs the CPU one" >&2
    exit 0
fi
OUT_DIR=${GPU_OUT:-bench-out/gpu}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0)
print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
timeout -s INT -k 20 "${TEST_SECONDS:-180}" "$PY" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    tests/test_cuda.py \
    2>&1 | grep -v "^DEBUG" | tee "$OUT_DIR/tests.log"
tests=${PIPESTATUS[0]}
timeout -s INT "${BENCH_SECONDS:-360}" "$PY" -m benchmarks --device cuda --precision bf16 --repetitions 5 \
    --min-seconds 1 --equivalence-steps 0 --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/bench.log"
bench=${PIPESTATUS[0]}
timeout -s INT "${LOOPS_SECONDS:-150}" "$PY" -m benchmarks --device cuda --loops-only --repetitions 3 \
    --equivalence-steps 0 --out "$OUT_DIR/loops" --loops flux/flowgrpo-bf16/auto wan/dancegrpo-bf16/auto \
    flux/flow-factory/auto flux/flowgrpo-bf16 wan/dancegrpo-bf16 flux/flow-factory 2>&1 | tee "$OUT_DIR/loops.log"
loops=${PIPESTATUS[0]}
timeout -s INT "${BF16_SECONDS:-90}" "$PY" -m benchmarks.bf16_equivalence --device cuda 2>&1 | tee "$OUT_DIR/bf16.log"
bf16=${PIPESTATUS[0]}
echo "benchmarks/gpu.sh: tests exit $tests, benchmark exit $bench, loops exit $loops, bf16 equivalence exit $bf16"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$loops" -eq 0 ] && [ "$bf16" -eq 0 ]
