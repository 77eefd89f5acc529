"""The ``ngram-cupy`` command line (``main.py``)."""
