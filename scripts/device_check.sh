#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the device tool): GPU tests, then every benchmark
# section the machine can run. Nothing is installed: the device image already has CuPy, Numba,
# PyTorch, PyArrow, safetensors, ml_dtypes, tqdm and pytest, so the checkout runs from PYTHONPATH.
# Results land in $OUT (the device tool's folder) or ./device-results.
#   device run:  bash scripts/device_check.sh        (timeout_s 420 leaves room for one rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
import cupy, numba, numpy, torch
props = cupy.cuda.runtime.getDeviceProperties(0)
print(props["name"].decode(), "| CuPy", cupy.__version__, "| Numba", numba.__version__,
      "| NumPy", numpy.__version__, "| torch", torch.__version__, torch.cuda.is_available())
PY
timeout 180 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.txt"
cp BENCHMARKS.md "$out/BENCHMARKS.md" 2>/dev/null || true
timeout 200 python3 bench.py --device gpu --output "$out/BENCHMARKS.md" 2>&1 | tee "$out/bench.txt"
