"""Pure-torch reference semantics of every op (CPU and GPU): the contracts tests and benchmarks share."""
