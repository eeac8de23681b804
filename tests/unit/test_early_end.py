"""The early end of turn: the endpointer ends after the shorter silence only when the completeness check
says so, never later than the full wait; resumed speech continues the utterance; the language model's
sentence-end probability is what the check uses (demo-asr's lm.arpa). Frames are pushed one by one:
stream time, no sleeps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.audio.vad import EndpointConfig, Endpointer, SpeechAudio, SpeechEnd, SpeechStart
from edge_agent.models.ctc_lexicon import Lexicon, NgramLM, read_language
from tests.scripted_vad import FRAME, RATE, Script, frames


def run(voiced: list[bool], complete, early_ms: int | None = 200, full_ms: int = 500):
    cfg = EndpointConfig(min_speech_ms=60, trailing_silence_ms=full_ms, pre_roll_ms=100, early_silence_ms=early_ms)
    ep = Endpointer(Script(voiced), cfg, RATE, complete=complete)
    events = []
    for k in range(len(voiced)):
        for e in ep.push(np.full(FRAME, 0.1, np.float32)):
            events.append((k, e))
    return ep, events


def ends(events):
    return [(k, e) for k, e in events if isinstance(e, SpeechEnd)]


def test_a_complete_utterance_ends_after_the_short_silence():
    voiced = [True] * frames(1000) + [False] * frames(1000)
    asked = []
    _, events = run(voiced, lambda n: asked.append(n) or True)
    ((k, end),) = ends(events)
    assert end.reason == "early"
    assert k == frames(1000) + frames(200) - 1  # the 10th silent frame
    assert round(end.at_s - end.speech_end_s, 3) == 0.2
    # the check is told the utterance's audio up to its last voiced frame (pre-roll included)
    start = next(e for _, e in events if isinstance(e, SpeechStart))
    utt_start = round(start.at_s * RATE) + frames(60) * FRAME - start.audio.size  # where its audio begins
    assert asked[0] == round(end.speech_end_s * RATE) - utt_start


def test_an_incomplete_one_waits_the_full_silence_the_bound():
    voiced = [True] * frames(1000) + [False] * frames(1000)
    asked = []
    _, events = run(voiced, lambda n: asked.append(n) or False)
    ((k, end),) = ends(events)
    assert end.reason == "silence" and round(end.at_s - end.speech_end_s, 3) == 0.5
    assert len(asked) == frames(500) - frames(200)  # asked at every silent frame from 200 ms until the bound


@pytest.mark.parametrize("early_ms", [200, 500, 800])
def test_never_later_than_the_full_wait(early_ms):
    voiced = [True] * frames(600) + [False] * frames(1200)
    _, events = run(voiced, lambda n: False, early_ms=min(early_ms, 500))
    ((_, end),) = ends(events)
    assert end.at_s - end.speech_end_s <= 0.5 + 1e-9


def test_no_check_no_early_end():
    voiced = [True] * frames(600) + [False] * frames(1000)
    _, events = run(voiced, None)
    ((_, end),) = ends(events)
    assert end.reason == "silence"


def test_speech_within_the_full_wait_after_an_early_end_resumes_with_all_audio_since():
    # speech, 200 ms silence (early end), 100 ms more silence (300 ms pause in all), speech again
    voiced = [True] * frames(800) + [False] * frames(300) + [True] * frames(600) + [False] * frames(800)
    calls = iter([True] + [False] * 100)  # complete the first time, not after
    _, events = run(voiced, lambda n: next(calls))
    starts = [e for _, e in events if isinstance(e, SpeechStart)]
    assert [e.reason for _, e in ends(events)] == ["early", "silence"]
    assert [s.resumes for s in starts] == [False, True]
    # the resumed start's audio: every frame after the early end, the gap included
    k_end = ends(events)[0][0]
    k_start = next(k for k, e in events if isinstance(e, SpeechStart) and e.resumes)
    assert starts[1].audio.size == (k_start - k_end) * FRAME


def test_speech_after_the_full_wait_is_a_new_utterance():
    voiced = [True] * frames(800) + [False] * frames(700) + [True] * frames(600) + [False] * frames(800)
    calls = iter([True] + [False] * 100)
    _, events = run(voiced, lambda n: next(calls))
    starts = [e for _, e in events if isinstance(e, SpeechStart)]
    assert [s.resumes for s in starts] == [False, False]


def test_audio_is_not_lost_across_an_early_end():
    """Utterance audio before the early end + the resumed start's audio = the stream from the first start."""
    voiced = [True] * frames(800) + [False] * frames(300) + [True] * frames(400) + [False] * frames(800)
    calls = iter([True] + [False] * 100)
    _, events = run(voiced, lambda n: next(calls))
    first = [e for _, e in events[: next(i for i, (_, e) in enumerate(events) if isinstance(e, SpeechEnd)) + 1]]
    n_first = sum(e.audio.size for e in first if isinstance(e, SpeechStart | SpeechAudio))
    resumed = next(e for _, e in events if isinstance(e, SpeechStart) and e.resumes)
    k_first_start = next(k for k, e in events if isinstance(e, SpeechStart))
    k_resumed = next(k for k, e in events if isinstance(e, SpeechStart) and e.resumes)
    first_start = next(e for _, e in events if isinstance(e, SpeechStart))
    assert n_first + resumed.audio.size == (k_resumed - k_first_start) * FRAME + first_start.audio.size


# -- the completeness check: demo-asr's word LM ---------------------------------------------------

DEMO_ASR = Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models" / "demo-asr"


@pytest.fixture(scope="module")
def language() -> tuple[Lexicon, NgramLM]:
    lexicon, lm, _ = read_language(DEMO_ASR, {})
    assert lexicon is not None and lm is not None
    return lexicon, lm


def test_the_lm_says_a_command_is_complete_and_a_sentence_start_is_not(language):
    from edge_agent.config.runtime import AudioConfig

    lexicon, lm = language
    threshold = AudioConfig().early_end_min_prob
    for done in ("turn on the kitchen lights", "set the bedroom temperature to twenty one degrees"):
        assert lm.end_probability(done.split(), lexicon) >= threshold, done
    for cut in ("turn on the", "set the bedroom temperature", "turn off the"):
        assert lm.end_probability(cut.split(), lexicon) < threshold, cut


def test_an_unfinished_last_word_is_completed_from_the_lexicon(language):
    lexicon, lm = language
    # "ligh" is what the streaming model says before its look-ahead lets out the last letters
    p = lm.end_probability("turn on the kitchen ligh".split(), lexicon)
    words = [w for w in lexicon.words if w.startswith("ligh") and (w,) in lm.entries]
    hist = ("<s>", "turn", "on", "the", "kitchen")
    weights = [10 ** lm.log10p(hist, w) for w in words]
    ends_ = [10 ** lm.log10p((*hist, w), "</s>") for w in words]
    assert p == pytest.approx(sum(a * b for a, b in zip(weights, ends_)) / sum(weights))
    assert lm.end_probability("turn on the kitchen ligh".split()) == 0.0  # without a lexicon: unknown word


class _Engine:
    """A recogniser that hears "turn on the lights" up to the audio it has taken (stream time in the text).
    ``lag``: as a streaming model with look-ahead, its partials hold back the last letters ("turn on the
    ligh") until the stream has ended."""

    name, kind, sample_rate, max_utterance_s = "fake", "fake", RATE, 30.0

    def __init__(self, lag: bool = False, stamp: bool = False, clock=None, said: str = "turn on the lights") -> None:
        self.lag, self.stamp, self.clock, self.said = lag, stamp, clock, said

    def new_stream(self):
        from edge_agent.models.recognizer import AudioStream

        return AudioStream(RATE)

    def step(self, streams):
        from edge_agent.models.recognizer import Hypothesis

        if self.clock is not None:
            self.clock.t += 0.03  # each step takes 30 ms on the service's clock
        out = []
        for s in streams:
            _, ended = s.take()
            text = self.said[:-2] if self.lag and not ended else self.said
            if self.stamp and ended:  # a decode that reads the trailing silence too: its length in the text
                text += f" {s.samples_in}"
            out.append(Hypothesis(text, (), ended, "", s.samples_in / RATE))
        return out

    def close(self):
        pass


class _Clock:
    """The service's clock: only the fake engine's steps move it."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _serve(
    voiced: list[bool],
    early_end=None,
    pause_ms: int | None = None,
    stream_early: bool = True,
    complete=None,
    lm: bool = True,
    p_end: float = 1.0,
    lag: bool = False,
    stamp: bool = False,
    clock=None,
    urgency=None,
    said: str = "turn on the lights",
):
    """``voiced`` fed frame by frame through an AsrService on ``_Engine``, each step asked for by a frame
    finished before the next: (the stream, its events as (frame index, event)). ``urgency``: the one the
    service's recogniser tells of speech (else the process's)."""
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService

    svc = AsrService(
        _Engine(lag, stamp, clock, said),
        limits=BatchLimits(max_batch=1, batch_timeout_ms=0),
        endpoint=EndpointConfig(60, 500, 100),
        detector_factory=lambda: Script(voiced),
        chunk_ms=10_000,  # no steps but the first and those the early end or a pause asks for
        early_end=early_end,
        end_probability=(lambda text: p_end if text.endswith("lights") else 0.0) if lm else None,
        **({"clock": clock} if clock is not None else {}),
    ).start()
    if urgency is not None:
        svc.batcher.urgency = urgency
    events: list = []
    frame = [0]
    try:
        on_event = lambda e: events.append((frame[0], e))  # noqa: E731
        st = svc.open_stream(on_event=on_event, pause_ms=pause_ms, early_end=stream_early, complete=complete)
        for frame[0] in range(len(voiced)):
            st.feed(np.full(FRAME, 0.1, np.float32))
            st.wait_steps(10.0)
        st.close()
        assert st.wait(10.0)
    finally:
        svc.stop()
    return st, events


def test_the_stream_ends_early_only_from_a_partial_that_covers_the_speech():
    """The partial known when the silence starts covers only part of the speech, so a step is asked for;
    its partial (complete) ends the utterance at the next frame."""
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    st, timed = _serve(voiced, early_end=EarlyEnd(200, 0.5))
    events = [e for _, e in timed]
    (final,) = [e for e in events if e.kind == "final"]
    assert final.metrics.reason == "early"
    speech_end, decided = st.endpoint(final.utterance)
    assert decided >= speech_end
    # asked at 200 ms of silence, ended once the step's partial covered the speech: well before 500 ms
    partials = [e for e in events if e.kind == "partial"]
    assert partials and final.audio_s - 1.0 < 0.5
    assert not any(e.paused for e in partials)  # no pause partials unless the stream asks for them


def test_a_stream_that_does_not_ask_for_the_early_end_waits_the_full_silence():
    """The service may end turns early (a voice turn's streams ask for it); a plain stream on it, an API
    client's transcription, keeps the full trailing-silence wait."""
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    st, timed = _serve(voiced, early_end=EarlyEnd(200, 0.5), stream_early=False)
    (final,) = [e for _, e in timed if e.kind == "final"]
    speech_end, decided = st.endpoint(final.utterance)
    assert final.metrics.reason == "silence" and round(decided - speech_end, 1) >= 0.5


@pytest.mark.parametrize(
    ("lm", "check", "reason"),
    [
        (True, lambda text: False, "silence"),  # the LM says complete; the stream's check vetoes it
        (True, lambda text: True, "early"),  # both agree
        (False, lambda text: True, "early"),  # no language model: the stream's check alone
        (False, None, "silence"),  # neither: never early
    ],
)
def test_the_stream_s_own_check_is_a_veto_on_the_language_model(lm, check, reason):
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    _, timed = _serve(voiced, early_end=EarlyEnd(200, 0.5), complete=check, lm=lm)
    (final,) = [e for _, e in timed if e.kind == "final"]
    assert final.metrics.reason == reason


def _waited_ms(st, final) -> float:
    speech_end, decided = st.endpoint(final.utterance)
    return round((decided - speech_end) * 1e3)


@pytest.mark.parametrize(
    ("check", "p_end", "reason", "waited_ms"),
    [
        (None, 1.0, "early", 200),  # the language model alone: the longer early silence
        (lambda text: True, 1.0, "early", 100),  # a whole command the LM agrees with: the shorter one
        (lambda text: True, 0.05, "early", 100),  # ... or does not rule out (>= command_min_prob)
        (lambda text: True, 0.01, "silence", 500),  # ... but an LM that rules the end out vetoes it
        (None, 0.3, "silence", 500),  # the LM alone, under min_prob: the full wait
        (lambda text: None, 1.0, "early", 200),  # a check that cannot tell leaves the LM alone
        (lambda text: None, 0.3, "silence", 500),
    ],
)
def test_the_stronger_the_evidence_the_shorter_the_silence(check, p_end, reason, waited_ms):
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    # pauses decoded at 60 ms: the text covering the speech is known before either silence is reached
    st, timed = _serve(voiced, early_end=EarlyEnd(200, 0.5, 100, 0.02), pause_ms=60, complete=check, p_end=p_end)
    (final,) = [e for _, e in timed if e.kind == "final"]
    assert final.metrics.reason == reason
    assert _waited_ms(st, final) == waited_ms


@pytest.mark.parametrize(
    ("said", "lm", "check", "reason", "waited_ms"),
    [
        ("What time is it?", False, lambda text: False, "early", 200),  # a whole question, no command to wait for
        ("What time is it?", False, lambda text: None, "early", 200),  # a check that cannot tell
        ("What time is it?", False, None, "silence", 500),  # a stream with no check of its own: never early
        ("What time is it", False, lambda text: False, "silence", 500),  # no question mark: no evidence
        ("Turn on the light.", False, lambda text: False, "silence", 500),  # a full stop says nothing
        ("What time is it?", True, None, "silence", 500),  # a word LM decides for its recogniser (p_end 0 here)
    ],
)
def test_without_a_language_model_a_question_mark_ends_the_turn_after_the_early_silence(
    said, lm, check, reason, waited_ms
):
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    st, timed = _serve(voiced, EarlyEnd(200, 0.5, 100, 0.02), pause_ms=60, complete=check, lm=lm, said=said)
    (final,) = [e for _, e in timed if e.kind == "final"]
    assert final.metrics.reason == reason and final.text == said
    assert _waited_ms(st, final) == waited_ms


@pytest.mark.parametrize("pause_ms", [None, 60])
def test_the_end_is_judged_on_the_pause_s_decode_not_on_a_lagging_partial(pause_ms):
    """The streaming partial lacks the last letters ("turn on the ligh"), which the whole-command check
    refuses; the pause's decode reads as the final will ("turn on the lights"), so a stream with pauses
    ends at the short silence and one without waits the full silence."""
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    check = lambda text: text.endswith("lights")  # noqa: E731
    st, timed = _serve(
        voiced, early_end=EarlyEnd(200, 0.5, 100, 0.02), pause_ms=pause_ms, complete=check, lm=False, lag=True
    )
    (final,) = [e for _, e in timed if e.kind == "final"]
    assert final.text == "turn on the lights"
    assert (final.metrics.reason, _waited_ms(st, final)) == (("early", 100) if pause_ms else ("silence", 500))


@pytest.mark.parametrize("stream_early", [True, False])
def test_with_no_speech_since_the_pause_its_decode_is_the_final(stream_early):
    """The final is the pause's decode (what the early end judged and a reply ahead was started on), not a
    second decode that also reads the later silence, whether the utterance ends early or after the full wait."""
    from edge_agent.serving.asr.service import EarlyEnd

    voiced = [True] * frames(1000) + [False] * frames(1000)
    check = lambda text: "lights" in text  # noqa: E731
    clock = _Clock()
    _, timed = _serve(
        voiced,
        early_end=EarlyEnd(200, 0.5, 100, 0.02),
        pause_ms=60,
        complete=check,
        lm=False,
        stamp=True,
        stream_early=stream_early,
        clock=clock,
    )
    events = [e for _, e in timed]
    (final,) = [e for e in events if e.kind == "final"]
    paused = [e for e in events if e.kind == "partial" and e.paused]
    assert final.metrics.reason == ("early" if stream_early else "silence")
    assert paused and (final.text, final.audio_s) == (paused[-1].text, paused[-1].audio_s)
    # its final_ms is that decode's time (one 30 ms step), not the 0 ms from the decision to the final
    assert final.metrics.final_ms == pytest.approx(30.0)


def test_a_pause_brings_the_partial_up_to_the_end_of_the_speech_once_per_pause():
    """With ``pause_ms``, each pause inside an utterance (and its end) gets one partial marked ``paused``,
    sent at the frame where the silence reaches ``pause_ms``, covering all the speech before it."""
    # speech, a 200 ms pause, speech, then silence to the end (the 500 ms wait ends the utterance)
    voiced = [True] * frames(600) + [False] * frames(200) + [True] * frames(400) + [False] * frames(800)
    _, events = _serve(voiced, pause_ms=60)
    pauses = [(k, e) for k, e in events if e.kind == "partial" and e.paused]
    first_pause = frames(600) + frames(60) - 1
    second_pause = frames(600) + frames(200) + frames(400) + frames(60) - 1
    assert [k for k, _ in pauses] == [first_pause, second_pause]
    # each covers the audio up to its pause (the fake engine's stream time: pre-roll + speech + the pause so far)
    assert [round(e.audio_s, 2) for _, e in pauses] == [round((k + 1) * FRAME / RATE, 2) for k, _ in pauses]
    (final,) = [e for _, e in events if e.kind == "final"]
    assert all(e.text == final.text for _, e in pauses)
    assert max(k for k, _ in pauses) < next(k for k, e in events if e.kind == "final")


@pytest.mark.parametrize("early", [False, True])
def test_a_stream_announces_its_speakers_turn_from_speech_start_to_speech_end(early):
    """While the speaker talks, a turn is coming (admission counts on it); from the end of speech it is a
    recogniser pass and a reply that hold the cores themselves, no longer announced. The utterance's length
    is learnt for the next one."""
    from edge_agent.serving.asr.service import EarlyEnd
    from edge_agent.serving.urgency import Urgency

    clock = _Clock()
    urgency = Urgency(clock=clock)
    voiced = [True] * frames(1000) + [False] * frames(1000)
    seen = []
    original = urgency.speech_started

    def started(key):
        original(key)
        seen.append(urgency.turns_expected(1e6))

    urgency.speech_started = started
    _, timed = _serve(voiced, early_end=EarlyEnd(200, 0.5) if early else None, clock=clock, urgency=urgency)
    assert len([e for _, e in timed if e.kind == "final"]) == 1
    assert seen == [1.0]  # one speaker announced at their speech start
    assert urgency.turns_expected(1e6) == 0.0  # and no longer once their speech ended
    assert urgency._speech_mean_s is not None and urgency._speech_mean_s > 0  # its length learnt


def test_a_stream_cut_short_while_its_speaker_talks_announces_nothing_more():
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService
    from edge_agent.serving.urgency import Urgency

    clock = _Clock()
    urgency = Urgency(clock=clock)
    voiced = [True] * frames(1000)
    svc = AsrService(
        _Engine(False, False, clock),
        limits=BatchLimits(max_batch=1, batch_timeout_ms=0),
        endpoint=EndpointConfig(60, 500, 100),
        detector_factory=lambda: Script(voiced),
        chunk_ms=10_000,
        clock=clock,
    ).start()
    svc.batcher.urgency = urgency
    try:
        st = svc.open_stream()
        for _ in range(frames(500)):
            st.feed(np.full(FRAME, 0.1, np.float32))
            st.wait_steps(10.0)
        assert urgency.turns_expected(1e6) == 1.0  # talking
        assert st.abort("client left") == 1
        assert urgency.turns_expected(1e6) == 0.0 and urgency._speech_mean_s is None  # cut: nothing learnt
    finally:
        svc.stop()
