"""Benchmarks for ngram_cupy: timers, data, load conditions, sections and the report.

``python bench.py --help`` lists the sections; every figure is measured in the same run as its
baselines, so ratios hold on any machine.
"""
