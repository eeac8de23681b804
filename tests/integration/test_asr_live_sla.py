"""One live SLA for speech: every ASR tier's adaptive batch wait reads the SLA in force through the
ladder (``TieredSpeech.set_sla``), so a reload, ``set_sla`` or the fleet's ``desired`` reach it at once,
including a tier loaded after the SLA changed; without one, a service keeps the value it was made with."""

from __future__ import annotations

from edge_agent.config import Settings
from edge_agent.serving.asr.tiers import open_speech


def test_the_asr_services_read_the_sla_in_force_at_each_use(tmp_path) -> None:
    settings = Settings.model_validate(
        {
            "models": {
                "asr": [{"name": "a", "model": "demo-asr"}, {"name": "b", "model": "demo-asr"}],
                "cache_dir": str(tmp_path / "m"),
            },
            "engines": {"cache_dir": str(tmp_path / "engines")},
            "sla": {"asr": {"target_ms": 300}},
        }
    )
    speech = open_speech(settings)
    try:
        service = speech._active.service
        assert service.target_ms() == 300.0  # made with the file's value
        in_force = [300.0]
        speech.set_sla(lambda: in_force[0])
        in_force[0] = 220.0  # e.g. a fleet set_sla: no reload of the service
        assert service.target_ms() == 220.0
        assert speech.switch_to(1)
        speech.wait_switched(60)
        in_force[0] = 180.0
        assert speech._active.service is not service and speech._active.service.target_ms() == 180.0
    finally:
        speech.stop()
