"""PLACEHOLDER being written now; replaced by the real op."""
compact_kv = None
