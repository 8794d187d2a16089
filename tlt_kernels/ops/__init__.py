"""Public ops: validation, then dispatch to a backend. Ops never import the runtime."""
