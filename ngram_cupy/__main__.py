"""``python -m ngram_cupy``: the ``ngram-cupy`` command line."""

import sys

from .cli.main import main

sys.exit(main())
