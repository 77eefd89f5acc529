"""Benchmarks for ngram_cupy (the ``benchmarks`` package): ``python bench.py --help``.

    python bench.py                        # every section this machine can run -> bench-results.md
    python bench.py --quick                # small sizes: about 4 minutes on a busy 2-core machine
    python bench.py --device gpu           # GPU sections only (needs CuPy and a device)
    python bench.py --sections ids-cpu --output -     # one section, printed only
    python bench.py --write-benchmarks-md  # refresh the tracked BENCHMARKS.md and benchmarks.png
"""

import sys

from benchmarks.run import main

if __name__ == "__main__":
    sys.exit(main())
