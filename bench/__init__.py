"""Benchmarks of tlt-kernels against their peers: ``python -m bench <suite|all> [--small] [--out DIR]``.

See :mod:`bench.harness` for the suite API and how each column is derived, ``bench/results/<card>/<suite>.json``
for the runs of record (:mod:`bench.records`), and docs/PERFORMANCE.md (``python -m bench report``) for the
figures and the rules for recording them.
"""
