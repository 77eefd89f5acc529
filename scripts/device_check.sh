#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the device tool), every figure in one try:
#   device run:  bash scripts/device_check.sh          (timeout_s 600; the script stops at 560 s)
#   here, no GPU: bash scripts/device_check.sh --dry-run  (the plan and its time boxes, GPU steps
#                 only named; the compile step runs one real kernel on the CPU)
# The machine's image has CuPy, numba-cuda, PyTorch, JAX, pytest with pytest-xdist and
# pytest-timeout, but no package index, and its transformers is older than the supported range.
# Bring what it lacks as wheels in .whl/ (ignored by git: `echo /.whl/ >> .git/info/exclude`),
# downloaded here without their dependencies, and name .whl in the device tool's `carry`:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.25.0 \
#       huggingface_hub==2.4.0 kernels==0.19.1 httpx2==2.17.0 httpcore2==2.17.0 truststore \
#       tomlkit==0.15.3
# (transformers 5.25 and what it needs beyond the image, as this venv has them; the versions
# step prints the image's click, hf-xet, idna, regex and tokenizers, to add if too old). They
# are unpacked into a folder after the checkout on the path, never from an index. At most five files come back in $OUT (./device-results):
#   summary.txt      the plan, then one line per step: exit status (124: out of time), seconds
#   results.tgz      every step's full log (remade after each step: a cut run keeps its logs)
#   packed-uva.md    the UVA gather of packed NVFP4 records vs fp8 rows vs two arrays
#   bench-results.md and bench-results.png   the GPU benchmark tables and plot (both rewritten
#                    after each section: a cut run keeps what it measured)
# Steps run most important first, each in its own time box; the boxes add up to the deadline
# (checked before anything runs), so no step eats the budget of those after it. A step is one
# line of PLAN and one function `step_NAME` below: adding one (a disk step) is two edits.
# The simulator, PTX, host-build and CPU tests run in CI, not here.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=1
fi
deadline="${DEVICE_CHECK_SECONDS:-560}"  # the device tool's 600 s, less a margin to pack logs

# name, time box in seconds, what it brings back (sized from measured or estimated times).
PLAN="
versions      15  GPU, driver, NVVM, NVRTC, CuPy, Numba, torch, JAX versions
compile       60  the kernel cache for sm_90, 16 CPUs (~40 s; 100 s on 2 loaded CPUs here)
gpu-tests    165  every test marked gpu, one pytest over the cores, most valuable files first
graph         15  torch.cuda.graph capture of forward, replayed on new tokens
misaligned    15  a table adopted 1 byte off an 8-byte boundary, plain and fused
fresh-fill    15  rows written, then read at once on another stream
torch-graphs  40  torch.compile reduce-overhead and torch.cuda.graph against eager (~30 s)
train         45  20 steps of every row optimizer on GPU tables against the CPU's bits (~30 s)
packed-uva    25  UVA gather of NVFP4 records / fp8 rows / two arrays against the copy (~15 s)
disk-gpu      30  GPU ids on a disk table: CPU bits, a joined prefetch, CUDA graph replays
jax-gpu       25  ngram_cupy.jax on CUDA arrays, eager and jitted, against the CPU (~15 s)
bench         70  bench.py --device gpu --quick: ids, gathers, fused, UVA, large pages, prefetch
memcheck      40  compute-sanitizer memcheck over every kernel once (small batches)
"

out="${OUT:-device-results}"
mkdir -p "$out"
logs="$(mktemp -d)"
summary="$out/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$dry_run" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:$site"
fi
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.numba-cache}"  # shared by the steps below
export NGRAM_CUPY_CACHE_DIR="${NGRAM_CUPY_CACHE_DIR:-$PWD/.kernel-cache}"  # kept between runs
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX takes what it uses, not 75% of the GPU

# CUDA_HOME only where NVVM is (numba-cuda takes CUDA_HOME first and finds no NVVM in a folder
# without it: every Numba kernel fails). An `nvcc` on the PATH may be a wrapper outside the
# toolkit, so its folder is only one candidate; with none, numba-cuda finds its NVVM wheel.
nvcc_path="$(command -v nvcc 2> /dev/null || true)"
cuda_home=""
for candidate in "${CUDA_HOME:-}" ${nvcc_path:+"$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")"} \
        /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$candidate" ] && [ -d "$candidate/nvvm" ]; then
        cuda_home="$candidate"
        break
    fi
done
if [ -n "$cuda_home" ]; then
    export CUDA_HOME="$cuda_home" PATH="$PATH:$cuda_home/bin"
else
    unset CUDA_HOME
fi

planned=$(echo "$PLAN" | awk 'NF { total += $2 } END { print total }')
{
    echo "device_check: $(date -u +%FT%TZ), CUDA_HOME=${CUDA_HOME:-unset (no folder with nvvm/)}, budget ${deadline} s$(
        [ "$dry_run" = 1 ] && echo ', dry run')"
    echo "plan: $planned s of time boxes for a ${deadline} s deadline"
    echo "$PLAN" | awk 'NF { name = $1; limit = $2; $1 = $2 = ""; sub(/^ +/, "")
                             printf "  %-13s %4d s  %s\n", name, limit, $0 }'
} > "$summary"
cat "$summary"
if [ "$planned" -gt "$deadline" ]; then
    echo "plan: the time boxes ($planned s) exceed the deadline ($deadline s)" | tee -a "$summary"
    exit 2
fi

pack() {  # every log so far into one file of $out
    tar -czf "$out/results.tgz" -C "$logs" . 2> /dev/null
}
trap 'pack; rm -rf "$logs"' EXIT

# run NAME LIMIT COMMAND...: COMMAND under `timeout` (at most what the run has left), its
# output in the step's log. In a dry run GPU commands are only named (CPU_STEP=1 runs them).
run() {
    local name="$1" limit="$2" left
    shift 2
    left=$((deadline - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[$name] at most ${limit} s: $*" >> "$logs/$name.txt"
    if [ "$dry_run" = 1 ] && [ "${CPU_STEP:-0}" != 1 ]; then
        echo "dry run: $*" >> "$logs/$name.txt"
        return 0
    fi
    timeout -s ABRT --kill-after=5 "$limit" "$@" >> "$logs/$name.txt" 2>&1
}

step_versions() {
    run versions "$1" python3 - <<'PY'
import os
from importlib import metadata

import cupy, numba, numba.cuda, numpy, torch

props = cupy.cuda.runtime.getDeviceProperties(0)
print(props["name"].decode(), "| CuPy", cupy.__version__, "| Numba", numba.__version__,
      "| NumPy", numpy.__version__, "| torch", torch.__version__, torch.cuda.is_available())
print("CUDA driver", cupy.cuda.runtime.driverGetVersion(), "| runtime",
      cupy.cuda.runtime.runtimeGetVersion(), "| CUDA_HOME", os.environ.get("CUDA_HOME"))
for name, probe in [
    ("NVVM", lambda: numba.cuda.cudadrv.nvvm.NVVM().get_version()),
    ("NVRTC", lambda: __import__("cuda.bindings.nvrtc", fromlist=["x"]).nvrtcVersion()),
    ("driver (cuda-bindings)",
     lambda: __import__("cuda.bindings.driver", fromlist=["x"]).cuDriverGetVersion()),
    ("nvJitLink", lambda: __import__("cuda.bindings.nvjitlink", fromlist=["version"]).version()),
] + [(package, lambda package=package: metadata.version(package)) for package in (
    "numba-cuda", "cuda-bindings", "jax", "transformers", "huggingface-hub", "kernels",
    "httpx2", "click", "hf-xet", "idna", "regex", "tokenizers", "safetensors",
    "pytest-timeout", "pytest-xdist")]:
    try:
        print(name, probe())
    except Exception as error:  # a diagnostic line, never a reason to stop
        print(name, "unavailable:", repr(error))
PY
}

step_compile() {  # every later process loads the released shapes' kernels from the cache
    local only=()
    [ "$dry_run" = 1 ] && only=(--only "advance_context[int64")  # one real kernel on a CPU
    CPU_STEP=1 run compile "$1" python3 -m ngram_cupy compile --arch sm_90 --jobs 16 \
        "${only[@]}"
}

# Test files marked gpu, at any depth, in the order they matter: the kernel cache, ids,
# gathers, prefetch and host waits, tiered storage, torch, then the rest by name.
GPU_TEST_ORDER="tests/runtime/test_kernel_cache.py tests/ids/ tests/tables/test_gather
tests/codecs/test_records.py tests/tables/test_prefetch.py tests/tables/test_host_syncs.py
tests/tables/storage/ tests/torch/"
gpu_test_files() {
    local marked pattern file listed=" "
    marked="$(grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)"
    for pattern in $GPU_TEST_ORDER; do
        for file in $marked; do
            if [[ "$file" == "$pattern"* && "$listed" != *" $file "* ]]; then
                listed+="$file "
            fi
        done
    done
    for file in $marked; do
        [[ "$listed" != *" $file "* ]] && listed+="$file "
    done
    echo $listed
}

step_gpu-tests() {  # one process: imports and the CUDA context paid once per worker
    local per_test=(-o faulthandler_timeout=60)  # without pytest-timeout: stacks of a hang
    if python3 -c "import pytest_timeout" 2> /dev/null; then
        per_test=(-p timeout --timeout 90)
    fi
    run gpu-tests "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -n "$(nproc)" \
        --durations=15 "${per_test[@]}" $(gpu_test_files)
}

step_graph() { run graph "$1" python3 scripts/gpu_workload.py graph; }
step_misaligned() { run misaligned "$1" python3 scripts/gpu_workload.py misaligned; }
step_fresh-fill() { run fresh-fill "$1" python3 scripts/gpu_workload.py fresh-fill; }
step_torch-graphs() { run torch-graphs "$1" python3 scripts/torch_graphs.py; }
step_train() { run train "$1" python3 scripts/gpu_workload.py train; }
step_packed-uva() {
    PACKED_UVA_OUT="$out/packed-uva.md" run packed-uva "$1" \
        python3 scripts/gpu_workload.py packed-uva
}
step_jax-gpu() { run jax-gpu "$1" python3 scripts/jax_gpu_check.py; }
step_disk-gpu() { run disk-gpu "$1" python3 scripts/disk_gpu_check.py; }
step_bench() {
    run bench "$1" python3 bench.py --device gpu --quick --output "$out/bench-results.md"
}

# memcheck only: out-of-bounds and misaligned accesses of gather.cu (no CPU test checks its
# bounds) and of every kernel over UVA. racecheck sees shared memory alone, which only the
# Numba ids kernels use, their barriers run by the simulator in CI.
step_memcheck() {
    if ! command -v compute-sanitizer > /dev/null && [ "$dry_run" = 0 ]; then
        echo "no compute-sanitizer on PATH" > "$logs/memcheck.txt"
        return 3
    fi
    run memcheck "$1" compute-sanitizer --tool memcheck --error-exitcode 3 \
        --target-processes all python3 scripts/gpu_workload.py kernels
}

while read -r name limit _; do
    [ -z "$name" ] && continue
    start=$SECONDS
    if [ $((deadline - SECONDS)) -lt 5 ]; then
        echo "$name: skipped, the run's ${deadline} s are spent" | tee -a "$summary"
        continue
    fi
    "step_$name" "$limit"
    status=$?
    echo "$name: exit $status, $((SECONDS - start)) s (limit $limit s)" | tee -a "$summary"
    tail -n 3 "$logs/$name.txt"
    pack
done <<< "$PLAN"

echo "total: $SECONDS s" >> "$summary"
echo "--- summary ($SECONDS s)"
cat "$summary"
