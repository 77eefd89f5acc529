#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the device tool), within 8 minutes in all:
#   device run:  bash scripts/device_check.sh          (timeout_s 480; the script stops at 420 s)
#   here, no GPU: bash scripts/device_check.sh --dry-run  (the same flow, GPU steps stubbed)
# Nothing is installed (the machine has no package index): the image already has CuPy, Numba
# with numba-cuda, PyTorch, PyArrow, safetensors, ml_dtypes, tqdm and pytest, and the checkout
# runs from PYTHONPATH. At most five files come back in $OUT (or ./device-results):
#   summary.txt      one line per step: exit status (124: out of time), seconds, its limit
#   results.tgz      every step's full log (remade after each step: a cut run keeps its logs)
#   packed-uva.md    the UVA gather of packed NVFP4 records vs fp8 rows vs two arrays
#   bench-results.md and bench-results.png   the GPU benchmark tables and plot
# Steps run most important first, each in its own time box (sized from measured times below),
# none past the run's deadline, so one hang or crash cannot eat the budget of those after it:
#   versions 5 s | compile the kernel cache: released shapes, sm_90, 16 CPUs: ~40 s (100 s on 2
#   loaded CPUs here, its slowest kernel 34 s) | gpu tests: ~150 s, each file its own pytest
#   (their kernels compiled once, then shared through the cache) | graph, misaligned,
#   fresh-fill: ~10 s each | torch-graphs: ~30 s (estimated) | train: ~30 s (estimated) |
#   packed-uva: ~15 s (estimated: 700 MiB of pinned rows made and filled, 3 x 22 timed gathers
#   and copies) | jax-gpu: ~15 s (estimated: jax's start and five small tables; not yet run on
#   a device) | bench --quick: ~60 s | memcheck, racecheck: ~45 s each
# The simulator, PTX, host-build and CPU tests run in CI, not here.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=1
fi
out="${OUT:-device-results}"
mkdir -p "$out"
logs="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Wheels carried in .whl/ (the device tool's `carry`; the image's transformers is older than the
# supported range) are unpacked into a folder after the checkout on the path, never from an index.
if [ "$dry_run" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:$site"
fi
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.numba-cache}"  # shared by the steps below
export NGRAM_CUPY_CACHE_DIR="${NGRAM_CUPY_CACHE_DIR:-$PWD/.kernel-cache}"  # kept between runs
if [ -z "${CUDA_HOME:-}" ]; then  # NVRTC's headers and compute-sanitizer live there
    if command -v nvcc > /dev/null; then
        CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    elif [ -d /usr/local/cuda ]; then
        CUDA_HOME=/usr/local/cuda
    fi
    [ -n "${CUDA_HOME:-}" ] && export CUDA_HOME
fi
if [ -n "${CUDA_HOME:-}" ] && [ -d "$CUDA_HOME/bin" ]; then
    export PATH="$PATH:$CUDA_HOME/bin"
fi
deadline="${DEVICE_CHECK_SECONDS:-420}"  # the device tool's 480 s, less a margin
summary="$out/summary.txt"
echo "device_check: $(date -u +%FT%TZ), CUDA_HOME=${CUDA_HOME:-unset}, budget ${deadline} s$(
    [ "$dry_run" = 1 ] && echo ', dry run')" > "$summary"

pack() {  # every log so far into one file of $out
    tar -czf "$out/results.tgz" -C "$logs" . 2> /dev/null
}
trap 'pack; rm -rf "$logs"' EXIT

# step NAME SECONDS COMMAND...: COMMAND under `timeout` (at most what the run has left), its
# output in the logs; one summary line. In a dry run GPU commands are only named.
step() {
    local name="$1" limit="$2" start=$SECONDS status left
    shift 2
    left=$((deadline - SECONDS))
    if [ "$left" -lt 5 ]; then
        echo "$name: skipped, the run's ${deadline} s are spent" | tee -a "$summary"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[$name] at most ${limit} s: $*"
    if [ "$dry_run" = 1 ] && [ "${CPU_STEP:-0}" != 1 ]; then
        echo "dry run: $*" > "$logs/$name.txt"
        status=0
    else
        timeout -s ABRT --kill-after=5 "$limit" "$@" > "$logs/$name.txt" 2>&1
        status=$?
    fi
    echo "$name: exit $status, $((SECONDS - start)) s (limit $limit s)" | tee -a "$summary"
    tail -n 3 "$logs/$name.txt"
    pack
}

step versions 20 python3 - <<'PY'
from importlib import metadata

import cupy, numba, numba.cuda, numpy, torch

props = cupy.cuda.runtime.getDeviceProperties(0)
print(props["name"].decode(), "| CuPy", cupy.__version__, "| Numba", numba.__version__,
      "| NumPy", numpy.__version__, "| torch", torch.__version__, torch.cuda.is_available())
print("CUDA driver", cupy.cuda.runtime.driverGetVersion(), "| runtime",
      cupy.cuda.runtime.runtimeGetVersion())
for name, probe in [
    ("numba-cuda", lambda: metadata.version("numba-cuda")),
    ("cuda-bindings", lambda: metadata.version("cuda-bindings")),
    ("NVRTC", lambda: __import__("cuda.bindings.nvrtc", fromlist=["x"]).nvrtcVersion()),
    ("nvJitLink", lambda: __import__("cuda.bindings.nvjitlink", fromlist=["version"]).version()),
]:
    try:
        print(name, probe())
    except Exception as error:  # a diagnostic line, never a reason to stop
        print(name, "unavailable:", repr(error))
PY

# 1. The kernel cache first: every later process loads the released shapes' kernels from it.
compile_only=()
[ "$dry_run" = 1 ] && compile_only=(--only "advance_context[int64")  # one real kernel on a CPU
CPU_STEP=1 step compile 90 python3 -m ngram_cupy compile --arch sm_90 --jobs 16 \
    "${compile_only[@]}"

# 2. The gpu tests, each file its own pytest run (a broken kernel in one cannot hide the others'
# results), sharing 170 s; the kernel cache and test files in the order they matter.
tests_end=$((SECONDS + 170))
for file in tests/runtime/test_kernel_cache.py $(grep -l "pytest.mark.gpu" tests/*/test_*.py \
        | grep -v test_kernel_cache.py); do
    left=$((tests_end - SECONDS))
    name="gpu-tests-$(basename "$file" .py)"
    if [ "$left" -lt 10 ]; then
        echo "$name: skipped, the tests' 170 s are spent" >> "$summary"
        continue
    fi
    step "$name" "$left" python3 -m pytest -q -m gpu --maxfail=3 -p no:cacheprovider \
        --durations=5 "$file"
done

# 3. Graph capture and the two hardware-only bug cases, each in its own process (a
# misaligned-address fault ends the CUDA context of the process that makes it).
step graph 30 python3 scripts/gpu_workload.py graph
step misaligned 20 python3 scripts/gpu_workload.py misaligned
step fresh-fill 20 python3 scripts/gpu_workload.py fresh-fill
# The torch layer compiled with mode="reduce-overhead" and captured with torch.cuda.graph,
# against eager (scripts/torch_graphs.py; Inductor's compile dominates: ~30 s estimated).
step torch-graphs 40 python3 scripts/torch_graphs.py

# 3b. GPU-trained tables: 20 steps of every row optimizer against the CPU's bits (~30 s estimated,
# most of it first compiles: the CPU update kernel twice, the GPU one twice; never run yet).
step train 60 python3 scripts/gpu_workload.py train

# 4. Packed NVFP4 records over UVA: bytes per token and GB/s of the gather from pinned memory,
# records vs fp8 rows vs two arrays, beside cudaMemcpy of the same bytes (packed-uva.md).
export PACKED_UVA_OUT="$out/packed-uva.md"
step packed-uva 30 python3 scripts/gpu_workload.py packed-uva

# 4b. ngram_cupy.jax on the GPU: ids and lookups of CUDA JAX arrays, eager and jitted, against
# the CPU's bits (XLA FFI custom calls on XLA's stream); skipped inside when jax has no CUDA.
step jax-gpu 30 python3 scripts/jax_gpu_check.py

# 4c. GPU ids on a placement="disk" table: CPU bits, a joined prefetch, CUDA graph replays of
# new ids (page-locked staging in stream order; never run yet).
step disk-gpu 30 python3 scripts/disk_gpu_check.py

# 5. The quick GPU benchmark (tables and plot straight into $out).
step bench 75 python3 bench.py --device gpu --quick --output "$out/bench-results.md"

# 6. Sanitizers on a short workload (every kernel once, small batches), with what is left.
if command -v compute-sanitizer > /dev/null || [ "$dry_run" = 1 ]; then
    for tool in memcheck racecheck; do
        step "sanitizer-$tool" 50 compute-sanitizer --tool "$tool" --error-exitcode 3 \
            --target-processes all python3 scripts/gpu_workload.py kernels
    done
else
    echo "sanitizers: skipped, no compute-sanitizer on PATH" >> "$summary"
fi

echo "total: $SECONDS s" >> "$summary"
echo "--- summary ($SECONDS s)"
cat "$summary"
