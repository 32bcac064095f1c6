#!/usr/bin/env bash
# The benchmark on one CUDA GPU: larger latents, bf16 autocast, the allocator's peak per program, and the live
# device in the planner (auto plans against its free memory). Where there is no CUDA it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu.sh: no CUDA device here (torch.cuda.is_available() is False): skipping the GPU benchmark;" \
         "make bench runs the CPU one" >&2
    exit 0
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB')"
exec "$PY" -m benchmarks --device cuda --precision bf16 --full --tunings lora full --repetitions 5 \
    --out bench-out/gpu "$@"
