"""Embedding tables: storage formats, their decoding, gathers, hot rows, prefetch and placements."""
