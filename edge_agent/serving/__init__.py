"""Serving: continuous batching for LLMs, dynamic batching for other models."""
