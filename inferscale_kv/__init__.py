"""What the memory service, the precompute workers and the inference nodes must agree on byte for byte:
KV profiles, the fact KV blob format, the prompt layout, context windows and the rotary composition."""
