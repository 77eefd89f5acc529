#!/bin/sh
# The README's two commands, run from anywhere in a clone with a stock python3 (3.10+):
#   sh scripts/setup.sh run    make or reuse .venv, install with the arrow and text extras, then
#                              write the n-gram ids of the sample corpus in data/
#   sh scripts/setup.sh test   make or reuse .venv, install the test extras (constraints-ci.txt),
#                              and the oldest supported transformers in .venv/oldest
#                              (requirements-oldest.txt), then run the test suite in two
#                              processes, as CI does (.ci/run);
#                              further arguments go to pytest (e.g. tests/hashing/test_config.py)
# .venv sees the interpreter's installed packages (--system-site-packages), so packages already
# there are not downloaded again; pip's own settings (PIP_EXTRA_INDEX_URL, ...) apply.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=${1:-}
case "$MODE" in
  run|test) shift ;;
  *) echo "usage: sh scripts/setup.sh run|test [pytest arguments]" >&2; exit 2 ;;
esac
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup.sh: ngram_cupy needs Python 3.10 or newer; '$PYTHON' is missing or older" \
       "(set PYTHON=...)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv --system-site-packages .venv; then
    rm -rf .venv
    echo "setup.sh: '$PYTHON -m venv' failed: install Python's venv module (Debian, Ubuntu:" \
         "sudo apt install python3-venv; Fedora: it comes with python3), then run this again" >&2
    exit 1
  fi
fi
if [ "$MODE" = run ]; then
  .venv/bin/python -m pip install -q -e ".[arrow,text]"
  OUT=${TMPDIR:-/tmp}/ngram_ids.parquet
  .venv/bin/ngram-cupy ids data/python_stdlib.parquet "$OUT" --config data/config.json \
    --text-column text --tokenizer qwen3.5 --column text_tokens --doc-id-column doc_id
  echo "setup.sh: wrote $OUT"
else
  .venv/bin/python -m pip install -q -e ".[test]" -c constraints-ci.txt
  # The oldest supported transformers beside it, for the test that reruns its tests there.
  OLDEST=$(sed -n 's/^transformers==//p' requirements-oldest.txt)
  if [ ! -d ".venv/oldest/transformers-$OLDEST.dist-info" ]; then
    rm -rf .venv/oldest
    .venv/bin/python -m pip install -q --no-deps --target .venv/oldest -r requirements-oldest.txt
  fi
  # Bytecode written even where PYTHONDONTWRITEBYTECODE is set (into the clone's __pycache__,
  # beside Numba's kernels): the suite starts many interpreters (workers, ranks, CLI and docs
  # runs), each of which would compile the sources again; a worker's collection took 3 s longer.
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
fi
