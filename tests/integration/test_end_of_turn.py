"""The end of turn on the real path: demo-asr (its word LM), espeak-ng speech, the voice turn's stream
settings from the default ``[audio]`` (pause decodes, the early end) and the home tools' whole-command
check. Audio goes in 20 ms blocks, each once the recogniser has caught up (stream time: no sleeps, and
the times compared are the endpointer's own silence counts)."""

from __future__ import annotations

import pytest

from edge_agent.bench.voice import HOME_TOOLS, Utterance, synthesize
from edge_agent.config.runtime import AudioConfig
from edge_agent.serving.doors.openai.output import load_tools
from edge_agent.serving.doors.voice.command_check import command_check
from tests.speech import require_tools


@pytest.fixture(scope="module")
def service():
    from edge_agent.config import Settings
    from edge_agent.models.asr import open_configured
    from edge_agent.serving.asr.factory import make_service

    # demo-asr named here: a module's fixture is made before the per-test default tiers are swapped in
    settings = Settings(models={"asr": [{"name": "ctc", "model": "demo-asr"}]})
    engine = open_configured(settings, None)
    svc = make_service(engine, settings.audio, settings.batching, early_end=True).start()
    yield svc
    svc.stop()
    engine.close()


def _run(service, utterance: Utterance, tools: bool):
    """The utterance (0.4 s of silence before it, 1.2 s after) through a voice-turn stream: (its finals,
    its paused partials, the silence waited before the last final's decision in ms)."""
    require_tools()
    audio = AudioConfig()
    clip = synthesize(utterance, 0.4, 1.2)
    check = command_check(load_tools(str(HOME_TOOLS))) if tools else None
    events: list = []
    stream = service.open_stream(on_event=events.append, pause_ms=audio.pause_ms, early_end=True, complete=check)
    block = audio.block_ms * 16
    for i in range(0, clip.samples.size, block):
        stream.feed(clip.samples[i : i + block])
        assert stream.wait_steps(60.0)
    stream.close()
    assert stream.wait(60.0)
    finals = [e for e in events if e.kind == "final"]
    paused = [e for e in events if e.kind == "partial" and e.paused]
    speech_end, decided = stream.endpoint(finals[-1].utterance)
    return finals, paused, round((decided - speech_end) * 1e3)


@pytest.mark.parametrize(
    "utterance",
    [
        Utterance(("turn the bedroom light on",), "en-us", 160),
        Utterance(("set a timer for ten minutes",), "en+f2", 190),
    ],
)
def test_a_whole_command_ends_after_the_command_silence_and_its_pause_decode_is_the_final(service, utterance):
    """demo-asr's bigram LM gives "... light on" P(end) 0.07: under the LM-alone threshold, above the
    one a whole command needs."""
    finals, paused, waited_ms = _run(service, utterance, tools=True)
    (final,) = finals
    assert final.metrics.reason == "early"
    frame_ms = AudioConfig().block_ms
    assert AudioConfig().command_end_silence_ms <= waited_ms <= AudioConfig().command_end_silence_ms + frame_ms
    assert paused and final.text == paused[-1].text
    assert final.metrics.final_ms > 0.0  # the pause decode's own time, not the 0 ms from the decision


def test_without_tools_the_language_model_alone_waits_the_longer_silence(service):
    finals, _, waited_ms = _run(service, Utterance(("turn on the kitchen lights",), "en-us", 160), tools=False)
    (final,) = finals
    audio = AudioConfig()
    assert final.metrics.reason == "early" and final.text == "turn on the kitchen lights"
    assert audio.early_end_silence_ms <= waited_ms <= audio.early_end_silence_ms + audio.block_ms


@pytest.mark.parametrize(
    "utterance",
    [
        Utterance(("turn on the", "kitchen lights"), "en-us", 160),
        Utterance(("make the kitchen", "twenty degrees"), "en+m3", 130),
    ],
)
def test_a_pause_after_words_that_are_not_a_whole_command_does_not_end_the_turn(service, utterance):
    finals, paused, _ = _run(service, utterance, tools=True)
    (final,) = finals  # one utterance: no early end at the 300 ms pause
    assert final.metrics.reason == "early"
    assert utterance.parts[1].split()[0] in final.text
    assert len(paused) >= 2  # the pause inside got its decode too, which did not end the turn
