"""PLACEHOLDER being written now; replaced by the real op."""
DraftTree = None
build_draft_tree = None
