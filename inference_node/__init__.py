"""Inference node: vLLM's OpenAI server with InferScale's KV connector and memory middleware."""
