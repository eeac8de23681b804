"""Benchmarks: ``edge-agent bench llm`` (agent vs a bare runtime loop, with a memory-bandwidth roofline)."""
