"""Benchmark suites, one module each, discovered by ``python -m bench``.

A suite module defines ``SUITE = "<name-with-dashes>"`` and ``run(ctx: bench.harness.BenchContext)``.
Keep imports of optional peers inside ``run`` (through ``ctx.try_import``) so discovery stays cheap
and never fails because a peer is missing.
"""
