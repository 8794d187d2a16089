"""PLACEHOLDER being written now; replaced by the real op."""
VerifyResult = None
verify_tree = None
