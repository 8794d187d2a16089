"""Triton kernels. Imported lazily by the backend tables; nothing here runs at package import."""
