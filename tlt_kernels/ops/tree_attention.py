"""PLACEHOLDER being written now; replaced by the real op."""
tree_attention = None
