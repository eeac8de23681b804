"""Serving: what turns loaded models into answers.

doors/          the front doors, on top: the HTTP API (doors/http/), the Wyoming server (doors/wyoming/),
                the voice turn (doors/voice/)
llm/            scheduler.py (LLMScheduler), tiers.py (TieredLLM)
asr/            service.py (AsrService), batcher.py, tiers.py (TieredSpeech)
tiers/          the tier machinery both workloads share, below them: ladder.py, policy.py, control.py,
                admission.py, engine_swap.py
batch_wait.py   AdaptiveWait (both workloads); urgency.py: voice first on the cores; capture.py
"""
