#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the device tool), at most 8 minutes in all:
#   device run:  bash scripts/device_check.sh        (timeout_s 500 leaves room for one rerun)
# Nothing is installed (the machine has no package index): the image already has CuPy, Numba
# with numba-cuda, PyTorch, PyArrow, safetensors, ml_dtypes, tqdm and pytest, and the checkout
# runs from PYTHONPATH. Every step has its own time box, so one hang or crash cannot eat the
# budget of the others; each step's output lands in $OUT (or ./device-results), and
# $OUT/summary.txt has one line per step: its exit status (124: out of time) and seconds.
#   1. versions   2. the gpu-marked tests, one pytest run per file
#   3. compute-sanitizer memcheck and racecheck of scripts/gpu_workload.py kernels
#   4. a torch.cuda.graph capture of forward with torch.from_dlpack
#   5. a misaligned device table and a fresh fill read on another stream
#   6. python bench.py --device gpu --quick
# The simulator, PTX, host-build and CPU tests run in CI, not here.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.numba-cache}"  # shared by the steps below
summary="$out/summary.txt"
: > "$summary"

# step NAME SECONDS COMMAND...: run COMMAND under `timeout`, output to $out/NAME.txt.
step() {
    local name="$1" limit="$2" start=$SECONDS status
    shift 2
    echo "[$name] at most ${limit} s: $*"
    timeout --kill-after=5 "$limit" "$@" > "$out/$name.txt" 2>&1
    status=$?
    echo "$name: exit $status, $((SECONDS - start)) s" | tee -a "$summary"
    tail -n 3 "$out/$name.txt"
}

step versions 30 python3 - <<'PY'
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

# 2. The gpu tests: 150 s across the files, each file its own pytest run (a broken kernel in one
# cannot hide the others' results).
deadline=$((SECONDS + 150))
for file in $(grep -l "pytest.mark.gpu" tests/test_*.py); do
    left=$((deadline - SECONDS))
    name="gpu-tests-$(basename "$file" .py)"
    if [ "$left" -lt 10 ]; then
        echo "$name: skipped, the tests' 150 s are spent" >> "$summary"
        continue
    fi
    step "$name" "$left" python3 -m pytest -q -m gpu --maxfail=3 -p no:cacheprovider \
        --durations=5 "$file"
done

# 3. Sanitizers on a short workload (every kernel once, small batches).
if command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
        step "sanitizer-$tool" 50 compute-sanitizer --tool "$tool" --error-exitcode 3 \
            --target-processes all python3 scripts/gpu_workload.py kernels
    done
else
    echo "sanitizers: skipped, no compute-sanitizer on PATH" >> "$summary"
fi

# 4-5. Graph capture and the two hardware-only bug cases, each in its own process (a
# misaligned-address fault ends the CUDA context of the process that makes it).
step graph 35 python3 scripts/gpu_workload.py graph
step misaligned 25 python3 scripts/gpu_workload.py misaligned
step fresh-fill 25 python3 scripts/gpu_workload.py fresh-fill

# 6. The quick GPU benchmark (tables in $out/bench-results.md).
step bench 85 python3 bench.py --device gpu --quick --output "$out/bench-results.md"

echo "--- summary ($SECONDS s)"
cat "$summary"
