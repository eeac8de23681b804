"""ASR tier switching: the real speech ladder, real ``AsrService``s and the real controller.

Recognisers with a settable step latency (each names itself and counts the samples it heard in its
text, so a final says which model decoded the utterance and whether it heard all of it) drive the
controller down and back up while streams are open: open streams finish on the tier they started
on, new ones go to the new tier, the old engine closes once its streams end, and nothing fails.
The last tests run the daemon's wiring (``Agent``) on the real demo models."""

from __future__ import annotations

import io
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from edge_agent.errors import EdgeAgentError, ModelError, Unavailable
from edge_agent.models.recognizer import AudioStream, Hypothesis
from edge_agent.serving.asr.batcher import BatchLimits
from edge_agent.serving.asr.service import AsrService
from edge_agent.serving.asr.tiers import SpeechTier, TieredSpeech
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import Policy

RATE = 16000
CHUNK = 5120  # 320 ms: one recogniser step per push


class Clock:
    """The controller's clock: decisions in test time, latencies measured in real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRecognizer:
    kind, sample_rate, max_utterance_s = "fake", RATE, 60.0

    def __init__(self, name: str, ladder: Ladder) -> None:
        self.name, self.ladder = name, ladder
        self.closed = False

    def new_stream(self) -> AudioStream:
        stream = AudioStream(RATE)
        stream.heard = 0
        return stream

    def step(self, streams):
        if self.closed:
            raise RuntimeError(f"{self.name}: step on a closed engine")
        time.sleep(self.ladder.latency_ms[self.name] / 1e3)
        out = []
        for s in streams:
            x, ended = s.take()
            s.heard += x.size
            if ended:
                s.finished = True
                out.append(Hypothesis(f"{self.name} heard {s.heard}", (), True, audio_s=s.heard / RATE))
            else:
                out.append(Hypothesis(f"{self.name} {s.heard}", (), False, audio_s=s.heard / RATE) if x.size else None)
        return out

    def close(self) -> None:
        with self.ladder.lock:
            self.closed = True
            self.ladder.loaded -= 1


class Ladder:
    """Two tiers of fake recognisers; counts engines in memory at once."""

    def __init__(self, heavy_ms: float, light_ms: float, light_fails: bool = False) -> None:
        self.latency_ms = {"heavy": heavy_ms, "light": light_ms}
        self.light_fails = light_fails
        self.engines: list[FakeRecognizer] = []
        self.lock = threading.Lock()
        self.loaded = self.peak = 0
        self.tiers = [
            SpeechTier("heavy", lambda: self._open("heavy")),
            SpeechTier("light", lambda: self._open("light")),
        ]

    def _open(self, name: str) -> FakeRecognizer:
        if name == "light" and self.light_fails:
            raise ModelError("light: model.onnx is truncated")
        engine = FakeRecognizer(name, self)
        with self.lock:
            self.engines.append(engine)
            self.loaded += 1
            self.peak = max(self.peak, self.loaded)
        return engine

    def in_memory(self) -> list[str]:
        return [e.name for e in self.engines if not e.closed]


def service_for(engine) -> AsrService:
    # No VAD: a stream is one utterance, ended by close().
    return AsrService(engine, limits=BatchLimits(max_batch=4, batch_timeout_ms=0), detector_factory=lambda: None)


POLICY = Policy(
    metric="first_partial_ms",
    percentile=95,
    target_ms=150.0,
    min_samples=3,
    downgrade_after=1,
    upgrade_after=1,
    upgrade_ratio=0.7,
    cooldown_s=0.0,
    min_dwell_s=0.0,
    min_token_cap_ratio=1.0,
    shed_after=100,
)


def build(ladder: Ladder, policy: Policy = POLICY, start: int = 0, drain_s: float = 30.0):
    events, observed, holder = [], [], {}

    def on_utterance(obs):
        observed.append((obs.tier, obs.samples))
        holder["c"].observe(obs)

    def on_switched(old, new, load_ms, error):
        if error:
            holder["c"].switch_failed(old, new, error)

    speech = TieredSpeech(ladder.tiers, service_for, on_utterance, on_switched, drain_s=drain_s).start(start)
    holder["c"] = controller = TierController(
        speech,
        policy,
        window_s=60.0,
        evaluate_every_s=3600.0,
        on_event=lambda kind, payload: events.append((kind, payload)),
        clock=Clock(),
        workload="asr",
    )
    return speech, controller, events, observed


def pcm(n: int) -> bytes:
    return (np.sin(np.arange(n) * 0.05) * 8000).astype("<i2").tobytes()


class Client:
    """One live stream through ``TieredSpeech.open_stream``, as the WebSocket route drives it."""

    def __init__(self, speech: TieredSpeech) -> None:
        self.events: list[dict] = []
        self.pushed = 0
        self.stream = speech.open_stream(self.events.append)

    def push(self, samples: int = CHUNK, wait_partial: bool = True) -> None:
        before = len([e for e in self.events if e["kind"] == "partial"])
        self.stream.push(pcm(samples))
        self.pushed += samples
        deadline = time.monotonic() + 10
        while wait_partial and len([e for e in self.events if e["kind"] == "partial"]) == before:
            assert time.monotonic() < deadline, self.events
            time.sleep(0.005)

    def close(self) -> str:
        self.stream.close()
        finals = [e for e in self.events if e["kind"] == "final"]
        assert len(finals) == 1 and not [e for e in self.events if e["kind"] == "error"], self.events
        return finals[0]["text"]


def utterance(speech: TieredSpeech, chunks: int = 2) -> str:
    client = Client(speech)
    for _ in range(chunks):
        client.push()
    return client.close()


def wait_active(speech: TieredSpeech, index: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while speech.active != index:
        assert time.monotonic() < deadline, f"still on tier {speech.active}"
        time.sleep(0.01)


def test_slow_heavy_tier_switches_down_and_back_up_without_cutting_an_utterance():
    ladder = Ladder(heavy_ms=250, light_ms=5)
    speech, controller, events, observed = build(ladder)
    clock = controller._clock
    try:
        long = Client(speech)  # opened on heavy; stays open across the switch
        long.push()
        assert [utterance(speech) for _ in range(3)] == [f"heavy heard {2 * CHUNK}"] * 3
        assert all(s["first_partial_ms"][0] > 150 for tier, s in observed)
        clock.now = 1.0
        assert controller.evaluate().action == "downgrade"
        wait_active(speech, 1)
        ((kind, payload),) = events
        assert (kind, payload["workload"], payload["from"], payload["to"]) == ("tier_switch", "asr", "heavy", "light")
        assert payload["snapshot"]["metric"] == "first_partial_ms" and payload["snapshot"]["value_ms"] > 150

        # New streams and uploads go to light; the long stream still decodes on heavy, which stays loaded.
        assert speech.switching and speech.open_streams == {"heavy": 1, "light": 0}
        assert utterance(speech, chunks=3) == f"light heard {3 * CHUNK}"
        import soundfile

        wav = io.BytesIO()
        soundfile.write(wav, np.frombuffer(pcm(8000), "<i2"), RATE, format="WAV", subtype="PCM_16")
        upload = speech.transcribe_bytes(wav.getvalue(), "a.wav")
        assert upload["text"] == "light heard 8000" and upload["model"] == "light"
        long.push()
        long.push()
        assert [e.name for e in ladder.engines if e.closed] == []
        assert long.close() == f"heavy heard {long.pushed}"  # every sample, one model, a correct final
        speech.wait_switched(10)
        assert not speech.switching and ladder.in_memory() == ["light"] and ladder.peak == 2
        assert observed[-1][0] == "heavy" and controller.window.count("requests", clock.now) == 2  # light's only

        # Fast light tier, light load: back up to a freshly loaded heavy; light closes once idle.
        utterance(speech)
        utterance(speech)
        clock.now = 20.0
        decision = controller.evaluate()
        assert decision.action == "upgrade", decision.reason
        wait_active(speech, 0)
        speech.wait_switched(10)
        assert ladder.in_memory() == ["heavy"] and len(ladder.engines) == 3 and ladder.peak == 2
        ladder.latency_ms["heavy"] = 5
        assert utterance(speech) == f"heavy heard {2 * CHUNK}"
        assert [p["to"] for k, p in events if k == "tier_switch"] == ["light", "heavy"]
    finally:
        speech.stop(1)
    assert ladder.in_memory() == []


def test_a_pin_overrides_a_fast_tier_and_unpin_returns_control():
    ladder = Ladder(heavy_ms=5, light_ms=5)
    speech, controller, events, _ = build(ladder)
    clock = controller._clock
    try:
        controller.pin("light")
        wait_active(speech, 1)
        speech.wait_switched(10)
        for t in (1.0, 2.0):
            for _ in range(3):
                assert utterance(speech) == f"light heard {2 * CHUNK}"
            clock.now = t
            assert controller.evaluate().action == "hold"  # fast, but pinned
        assert speech.active == 1 and events[-1][1]["action"] == "pin"
        controller.unpin()
        clock.now = 3.0
        assert controller.evaluate().action == "upgrade"
        wait_active(speech, 0)
    finally:
        speech.stop(1)


@pytest.mark.slow
def test_a_tier_that_cannot_load_keeps_the_current_one_serving():
    ladder = Ladder(heavy_ms=250, light_ms=5, light_fails=True)
    speech, controller, events, _ = build(ladder)
    try:
        long = Client(speech)
        long.push()
        for _ in range(3):
            utterance(speech)
        controller._clock.now = 1.0
        assert controller.evaluate().action == "downgrade"
        speech.wait_switched(10)
        assert speech.active == 0 and controller.state.tier == 0 and not speech.switching
        kind, payload = events[-1]
        assert kind == "tier_switch_failed" and "truncated" in payload["error"] and payload["workload"] == "asr"
        long.push()
        assert long.close() == f"heavy heard {long.pushed}"
        assert utterance(speech) == f"heavy heard {2 * CHUNK}"
        assert ladder.in_memory() == ["heavy"]
    finally:
        speech.stop(1)


@pytest.mark.slow
def test_shedding_at_the_lightest_tier_rejects_new_streams_but_finishes_open_ones():
    ladder = Ladder(heavy_ms=5, light_ms=250)
    policy = replace(POLICY, shed_after=1)
    speech, controller, _, _ = build(ladder, policy, start=1)
    try:
        open_one = Client(speech)
        open_one.push()
        for _ in range(3):
            utterance(speech)
        controller._clock.now = 1.0
        controller.evaluate()
        assert speech.shedding and speech.active == 1
        with pytest.raises(Unavailable, match="shedding"):
            speech.open_stream(lambda event: None)
        with pytest.raises(Unavailable, match="shedding"):
            speech.transcribe_bytes(b"RIFF....", "a.wav")
        open_one.push()
        assert open_one.close() == f"light heard {open_one.pushed}"
        assert speech.open_streams == {"light": 0}  # rejected attempts hold nothing
    finally:
        speech.stop(1)


def test_a_stream_left_open_past_the_drain_time_does_not_keep_the_old_engine():
    ladder = Ladder(heavy_ms=5, light_ms=5)
    speech, controller, _, _ = build(ladder, drain_s=0.3)
    try:
        stuck = Client(speech)
        stuck.push()
        assert speech.switch_to(1)
        assert not speech.switch_to(0)  # one switch at a time, its drain included
        speech.wait_switched(10)
        assert ladder.in_memory() == ["light"] and speech.open_streams == {"light": 0}
        stuck.push(wait_partial=False)  # its tier is gone: an error event, not an exception or a hang
        stuck.stream.close()
        assert [e for e in stuck.events if e["kind"] == "error"]
        assert utterance(speech) == f"light heard {2 * CHUNK}"
    finally:
        speech.stop(1)


# -- the daemon's wiring, on the real demo models --------------------------------------------------


def feed(stream, blocks: list[bytes]) -> None:
    for block in blocks:
        stream.push(block)


def _asr_settings(tmp_path, tiers: list[tuple[str, str]]):
    from edge_agent.config import load_settings

    lines = [f'[models]\ncache_dir = "{tmp_path / "models"}"']
    lines += [f'[[models.asr]]\nname = "{name}"\nmodel = "{model}"' for name, model in tiers]
    lines.append("[sla.asr]\ntarget_ms = 300\nevaluate_every_s = 3600\n")
    path = tmp_path / "agent.toml"
    path.write_text("\n".join(lines))
    return load_settings(path), path


def test_agent_switches_real_asr_tiers_while_a_stream_is_open(tmp_path):
    from edge_agent.daemon.app import Agent
    from edge_agent.telemetry.schema import SlaSpec
    from tests.speech import speech_samples

    samples = speech_samples("turn on the kitchen lights")
    blocks = [
        (np.clip(samples[i : i + 1600], -1, 1) * 32767).astype("<i2").tobytes() for i in range(0, len(samples), 1600)
    ]
    settings, path = _asr_settings(tmp_path, [("top", "demo-asr"), ("light", "demo-ctc")])
    agent = Agent(settings, str(path), drain_s=10)
    agent.asr = agent._start_asr()
    try:
        assert agent.asr_controller is not None and agent.asr.active_tier == "top"
        reported = agent.remote.reported()
        assert reported["active_tiers"]["asr"] == "top" and "asr" not in reported["pins"]
        assert reported["sla"]["asr"]["metric"] == "first_partial_ms" and reported["sla"]["asr"]["target_ms"] == 300

        reference: list[dict] = []
        stream = agent.asr.open_stream(reference.append)
        feed(stream, blocks)
        stream.close()
        ref_text = " ".join(e["text"] for e in reference if e["kind"] == "final" and e["text"]).strip()
        assert ref_text

        during: list[dict] = []
        stream = agent.asr.open_stream(during.append)
        feed(stream, blocks[: len(blocks) // 2])
        assert agent.remote.pin_tier("asr", "light") == {"pinned": "light"}
        wait_active(agent.asr, 1, timeout_s=60)
        reported = agent.remote.reported()
        assert reported["active_tiers"]["asr"] == "light" and reported["pins"]["asr"] == "light"

        light: list[dict] = []
        other = agent.asr.open_stream(light.append)
        feed(other, blocks)
        other.close()
        assert [e for e in light if e["kind"] == "final"] and not [e for e in light if e["kind"] == "error"]

        feed(stream, blocks[len(blocks) // 2 :])
        stream.close()
        assert not [e for e in during if e["kind"] == "error"]
        assert " ".join(e["text"] for e in during if e["kind"] == "final" and e["text"]).strip() == ref_text
        agent.asr.wait_switched(30)
        assert agent.asr.open_streams == {"light": 0}  # the top tier is gone from memory

        assert agent.remote.set_sla("asr", SlaSpec(metric="final_ms", target_ms=500))["sla"]["target_ms"] == 500
        assert agent.remote.reported()["sla"]["asr"]["metric"] == "final_ms"
        with pytest.raises(EdgeAgentError, match="ASR SLA metric"):
            agent.remote.set_sla("asr", SlaSpec(metric="ttft_ms", target_ms=500))
        agent.remote.unpin_tier("asr")
        assert "asr" not in agent.remote.reported()["pins"] and agent.asr_controller.state.pinned is None

        path.write_text(path.read_text().replace("target_ms = 300", "target_ms = 250"))
        assert "reloaded" in agent.reload()
        assert agent.asr_controller.policy.target_ms == 250 and agent.asr_controller.policy.metric == "first_partial_ms"
    finally:
        agent.stop()
    assert agent.asr.active_tier is None


def test_one_asr_tier_runs_no_controller(tmp_path):
    from edge_agent.daemon.app import Agent

    settings, path = _asr_settings(tmp_path, [("ctc", "demo-asr")])
    agent = Agent(settings, str(path))
    agent.asr = agent._start_asr()
    try:
        assert agent.asr is not None and agent.asr_controller is None
        assert "tiers-asr" not in [t.name for t in threading.enumerate()]
        assert agent.remote.reported()["active_tiers"] == {"asr": "ctc"} and "asr" not in agent.remote.reported()["sla"]
        with pytest.raises(EdgeAgentError, match="no tier controller"):
            agent.remote.pin_tier("asr", "ctc")
    finally:
        agent.stop()
