"""The LLM workload: ``scheduler`` (``LLMScheduler``: continuous batching of one loaded model on one
device thread) and ``ladder`` (``TieredLLM``: the tiers, one scheduler serving the active one,
switched without failing a request). Symmetric with ``serving.asr``."""
