"""Precompute workers: compute each fact's KV (Chunked RoPE + Context-Window Encoding) for a model profile."""
