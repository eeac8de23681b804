"""Serving: what turns loaded models into answers.

llm/            scheduler.py (LLMScheduler), tiers.py (TieredLLM)
asr/            service.py (AsrService), batcher.py, tiers.py (TieredSpeech)
tier_ladder.py  what both ladders share: the active tier, one background switch, the first tier that loads
tier_policy.py  the pure decision (decide) and the policy from config
tier_control.py the controller thread that applies it
doors/          the front doors: the HTTP API (doors/http/), the Wyoming server (doors/wyoming/), the voice
                turn (doors/voice/)
"""
