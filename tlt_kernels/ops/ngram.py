"""PLACEHOLDER being written now; replaced by the real op."""
NGramDrafts = None
ngram_propose = None
