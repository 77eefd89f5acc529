"""Tables sharded across ranks: the lookup (``lookup.py``) and its optimizer (``optimizer.py``)."""
