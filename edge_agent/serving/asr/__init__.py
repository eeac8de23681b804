"""The ASR workload: ``service`` (``AsrService``: endpointed streams of one loaded recogniser),
``batcher`` (its device thread: decode steps of many streams batched) and ``ladder`` (``TieredSpeech``:
the tiers, one service serving the active one, switched without cutting an utterance). Symmetric
with ``serving.llm``."""
