"""Benchmarks of tlt-kernels against their peers: ``python -m bench <suite|all> [--small] [--out DIR]``.

See :mod:`bench.harness` for the suite API and how each column is derived, and ``bench/RESULTS.md``
for recorded figures and the rules for recording them.
"""
