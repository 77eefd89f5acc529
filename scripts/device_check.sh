#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the device tool): GPU tests, then every benchmark
# section the machine can run. Nothing is installed: the device image already has CuPy, Numba
# (with numba-cuda), PyTorch, PyArrow, safetensors, ml_dtypes, tqdm and pytest, so the checkout
# runs from PYTHONPATH. Results land in $OUT (the device tool's folder) or ./device-results.
#   device run:  bash scripts/device_check.sh        (timeout_s 420 leaves room for one rerun)
# Only the tests marked gpu run here: the rest (simulator and PTX checks included) take about
# two minutes with cold Numba caches and run in CI. Each test file gets its own pytest run, so a
# broken kernel in one (say the Numba ids kernel) cannot hide the results of the others.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
from importlib import metadata

import cupy, numba, numba.cuda, numpy, torch

props = cupy.cuda.runtime.getDeviceProperties(0)
print(props["name"].decode(), "| CuPy", cupy.__version__, "| Numba", numba.__version__,
      "| NumPy", numpy.__version__, "| torch", torch.__version__, torch.cuda.is_available())
print("CUDA driver", cupy.cuda.runtime.driverGetVersion(), "| runtime",
      cupy.cuda.runtime.runtimeGetVersion())
for name, probe in [
    ("numba-cuda", lambda: metadata.version("numba-cuda")),
    ("Numba's PTX", lambda: next(line for line in numba.cuda.compile_ptx(
        lambda a: None, (numba.types.int64[::1],), cc=(9, 0))[0].splitlines()
        if line.startswith(".version"))),  # must not be newer than the driver without nvJitLink
    ("nvJitLink", lambda: __import__("cuda.bindings.nvjitlink", fromlist=["version"]).version()),
]:
    try:
        print(name, probe())
    except Exception as error:  # a diagnostic line, never a reason to stop
        print(name, "unavailable:", repr(error))
PY
deadline=$((SECONDS + 230))
for file in $(grep -l "pytest.mark.gpu" tests/test_*.py); do
    left=$((deadline - SECONDS))
    if [ "$left" -lt 10 ]; then echo "[skip] $file: the tests' 230 s are spent"; continue; fi
    echo "[run] $file (at most ${left} s)"
    timeout "$left" python3 -m pytest -q -m gpu --maxfail=3 -p no:cacheprovider --durations=5 \
        "$file"
done 2>&1 | tee "$out/gpu-tests.txt"
cp BENCHMARKS.md "$out/BENCHMARKS.md" 2>/dev/null || true
timeout 150 python3 bench.py --device gpu --output "$out/BENCHMARKS.md" 2>&1 | tee "$out/bench.txt"
