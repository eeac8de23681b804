"""VoiceTurn with a fake clock and a fake scheduler: prefill ahead, the final's reply, early replies
cancelled when the utterance continues, false cuts counted. Events are ordered explicitly (no sleeps)."""

from __future__ import annotations

import json
import threading

from edge_agent.metrics.timing import RequestTiming
from edge_agent.metrics.window import WARMUP
from edge_agent.serving.asr.events import AsrEvent, UtteranceMetrics
from edge_agent.serving.doors.voice.turn import VoiceTurn
from edge_agent.serving.llm.admission import INTERACTIVE
from edge_agent.serving.llm.handle import Completion, RequestHandle, TokenEvent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_light",
            "description": "Switch a light",
            "parameters": {
                "type": "object",
                "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                "required": ["room", "on"],
            },
        },
    }
]
CALL = json.dumps({"name": "set_light", "arguments": {"room": "kitchen", "on": True}})


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeLLM:
    """Records every submit; the test finishes each handle when it wants."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, object, tuple]] = []
        self.handles: list[RequestHandle] = []
        self.submitted = threading.Condition()

    def __call__(self, chat, params, tags=()):
        h = RequestHandle(len(self.handles) + 1)
        with self.submitted:
            self.calls.append((list(chat), params, tuple(tags)))
            self.handles.append(h)
            self.submitted.notify_all()
        return h

    def wait_for(self, n: int) -> RequestHandle:
        with self.submitted:
            assert self.submitted.wait_for(lambda: len(self.handles) >= n, 10.0)
            return self.handles[n - 1]


def reply(h: RequestHandle, text: str, times: list[float], cached: int = 0, prompt: int = 100) -> None:
    for i, t in enumerate(times):
        h.push(TokenEvent(i, text if i == len(times) - 1 else "", t))
    timing = RequestTiming(times[0] - 0.1, times[0] - 0.1, tuple(times), times[-1], prompt, cached_tokens=cached)
    h.finish(Completion(text, tuple(range(len(times))), "stop", timing))


def cancelled(h: RequestHandle, at: float) -> None:
    h.finish(Completion("", (), "cancelled", RequestTiming(at, None, (), at)))


def start(utt: int, at: float = 0.0) -> AsrEvent:
    return AsrEvent("speech_start", 0, utt, at_s=at)


def partial(utt: int, text: str) -> AsrEvent:
    return AsrEvent("partial", 0, utt, text)


def final(utt: int, text: str, decided: float, reason: str = "silence") -> AsrEvent:
    m = UtteranceMetrics(100.0, 5.0, 0.02, 1.0, 20.0, reason)
    return AsrEvent("final", 0, utt, text, text, 1.0, decided, m, decided)


def turn(llm, clock, **kw) -> VoiceTurn:
    return VoiceTurn(llm, TOOLS, clock=clock, tick_s=None, **kw)


def test_a_partial_is_prefilled_once_stable_with_one_token_and_the_warmup_tag():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock, stable_ms=120)
    vt.on_event(start(0))
    vt.on_event(partial(0, "turn on the kitchen"))
    clock.t += 0.119
    assert not vt.tick() and not llm.calls
    clock.t += 0.002
    assert vt.tick()
    chat, params, tags = llm.calls[0]
    assert chat == vt.chat("turn on the kitchen")  # the final's template and tools
    assert params.max_new_tokens == 1 and tags == (WARMUP, INTERACTIVE)
    assert not vt.tick()  # the same text is not prefilled twice


def test_prefills_ahead_are_bounded_one_in_flight_and_n_per_utterance():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock, stable_ms=100, max_prefills=2)
    vt.on_speech_start(start(0))
    for k, text in enumerate(["turn", "turn on", "turn on the", "turn on the light"]):
        vt.on_partial(partial(0, text))
        clock.t += 0.2
        sent = vt.tick()
        if k == 1:
            assert not sent  # the first is still in flight
            reply(llm.handles[0], "x", [clock.t])
            assert vt.tick()
    assert len(llm.calls) == 2 and vt.prefills == 2  # the budget: 2 per utterance


def test_no_prefill_ahead_when_off():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock, prefill_ahead=False)
    vt.on_partial(partial(0, "turn on the"))
    clock.t += 1.0
    assert not vt.tick() and not llm.calls


def _run_final(vt, event, speech_end_s=None):
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=vt.on_final(event, speech_end_s)), daemon=True)
    th.start()
    return th, out


def test_the_final_prompt_is_the_partials_and_timings_run_from_the_end_of_speech():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(0))
    vt.on_partial(partial(0, "turn on the kitchen light"))
    clock.t += 0.2
    vt.tick()
    reply(llm.handles[0], "{", [clock.t])
    th, out = _run_final(vt, final(0, "turn on the kitchen light", decided=10.5), speech_end_s=10.0)
    h = llm.wait_for(2)
    assert llm.calls[1][0] == llm.calls[0][0] and llm.calls[1][2] == (INTERACTIVE,)  # same prompt, a real request
    reply(h, CALL, [10.6, 10.7, 11.2], cached=96, prompt=100)
    th.join(10)
    r = out["r"]
    assert r.delivered and r.call == {"name": "set_light", "arguments": {"room": "kitchen", "on": True}}
    assert round(r.endpoint_ms) == 500 and round(r.turn_first_token_ms) == 600 and round(r.turn_complete_ms) == 1200
    assert r.cached_tokens == 96 and r.prefill_ahead == 1 and r.prefill_wasted == 0 and not r.early_end


def test_a_continued_utterance_cancels_the_early_reply_and_yields_exactly_one_call():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(3))
    th, out = _run_final(vt, final(3, "turn on the", decided=5.2, reason="early"), speech_end_s=5.0)
    early = llm.wait_for(1)
    vt.on_speech_start(start(3))  # the speaker goes on within the full wait
    assert early.cancelled
    cancelled(early, 5.3)
    th.join(10)
    assert not out["r"].delivered and out["r"].call is None and out["r"].early_end
    th, out2 = _run_final(vt, final(3, "turn on the kitchen light", decided=6.5), speech_end_s=6.0)
    reply(llm.wait_for(2), CALL, [6.6, 6.9])
    th.join(10)
    calls = [r.call for r in (out["r"], out2["r"]) if r.delivered and r.call]
    assert len(calls) == 1 and vt.false_cuts == 0 and vt.cancelled == 1


def test_a_resumption_seen_before_the_early_final_sends_nothing_for_it():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(1))
    vt.on_speech_start(start(1))  # continued before the early final was taken
    r = vt.on_final(final(1, "turn on the", decided=5.2, reason="early"), 5.0)
    assert not r.delivered and not llm.calls


def test_a_reply_delivered_before_the_speaker_went_on_is_a_false_cut():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(2))
    th, out = _run_final(vt, final(2, "turn on the kitchen", decided=5.2, reason="early"), speech_end_s=5.0)
    reply(llm.wait_for(1), CALL, [5.4])
    th.join(10)
    assert out["r"].delivered and out["r"].early_end
    vt.on_speech_start(start(2))
    assert vt.false_cuts == 1


def _false_cut_then_final(vt, llm, second_call: str):
    """Utterance 2 ends early, its call is delivered, the speaker goes on; the whole utterance's final
    then gets ``second_call``: (the second TurnResult, the texts its reply streamed to ``on_token``)."""
    vt.on_speech_start(start(2))
    th, out = _run_final(vt, final(2, "turn on the kitchen", decided=5.2, reason="early"), speech_end_s=5.0)
    reply(llm.wait_for(1), CALL, [5.4])
    th.join(10)
    assert out["r"].delivered
    vt.on_speech_start(start(2))
    streamed: list[str] = []
    done: dict = {}

    def run() -> None:
        done["r"] = vt.on_final(final(2, "turn on the kitchen light", decided=6.5), 6.0, on_token=streamed.append)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    h = llm.wait_for(2)
    h.push(TokenEvent(0, second_call[:10], 6.6))
    assert not streamed  # held until it is known whether it repeats the delivered call
    h.push(TokenEvent(1, second_call[10:], 6.7))
    h.finish(Completion(second_call, (0, 1), "stop", RequestTiming(6.5, 6.5, (6.6, 6.7), 6.7, 100)))
    th.join(10)
    return done["r"], streamed


def test_after_a_false_cut_the_same_call_is_not_delivered_twice():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    r, streamed = _false_cut_then_final(vt, llm, CALL)
    assert vt.false_cuts == 1 and vt.repeats == 1
    assert not r.delivered and r.repeated and r.call == json.loads(CALL) and not streamed


def test_after_a_false_cut_a_corrected_call_is_delivered():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    other = json.dumps({"name": "set_light", "arguments": {"room": "kitchen", "on": False}})
    r, streamed = _false_cut_then_final(vt, llm, other)
    assert vt.false_cuts == 1 and vt.repeats == 0
    assert r.delivered and not r.repeated and r.call == json.loads(other) and "".join(streamed) == other


def test_a_reply_ahead_is_the_final_s_and_reaches_the_caller_no_earlier_than_the_final():
    """A pause's reply is finished before the final comes: it is the final's reply (no second request),
    and its times are those of the final's arrival, never earlier."""
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(0))
    vt.on_partial(AsrEvent("partial", 0, 0, "turn on the kitchen light", paused=True))
    assert vt.tick()  # at once, no stable wait
    chat, params, tags = llm.calls[0]
    assert chat == vt.chat("turn on the kitchen light") and params.max_new_tokens > 1 and tags == (WARMUP, INTERACTIVE)
    reply(llm.handles[0], CALL, [10.10, 10.15])  # done before the final arrives (at 10.3)
    event = AsrEvent("final", 0, 0, "turn on the kitchen light", "", 1.0, 10.3, final(0, "", 10.2).metrics, 10.2)
    r = vt.on_final(event, speech_end_s=10.0)
    assert len(llm.calls) == 1 and r.reply_ahead and r.delivered and r.call is not None
    assert round(r.turn_first_token_ms) == 300 and round(r.turn_complete_ms) == 300  # floored at the final's 10.3
    assert vt.replies_ahead == vt.replies_ahead_used == 1


def test_a_later_pause_replaces_the_reply_ahead_and_a_final_that_reads_otherwise_gets_its_own():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(0))
    vt.on_partial(AsrEvent("partial", 0, 0, "turn on the", paused=True))
    assert vt.tick()
    vt.on_partial(AsrEvent("partial", 0, 0, "turn on the kitchen", paused=True))  # spoke on, paused again
    assert vt.tick()
    assert llm.handles[0].cancelled and not llm.handles[1].cancelled
    th, out = _run_final(vt, final(0, "turn on the kitchen light", decided=10.5), speech_end_s=10.0)
    fresh = llm.wait_for(3)
    assert llm.handles[1].cancelled and llm.calls[2][2] == (INTERACTIVE,)  # the final's own request
    reply(fresh, CALL, [10.6, 10.7])
    th.join(10)
    assert out["r"].delivered and not out["r"].reply_ahead and out["r"].prefill_wasted == 2
    assert vt.replies_ahead == 2 and vt.replies_ahead_used == 0


def test_a_long_lived_stream_keeps_a_bounded_amount_per_utterance():
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock, prefill_ahead=False)
    for utt in range(100):
        vt.on_speech_start(start(utt))
        th, out = _run_final(vt, final(utt, "turn on the kitchen light", decided=5.0 + utt, reason="early"))
        reply(llm.wait_for(utt + 1), CALL, [5.1 + utt])
        th.join(10)
        assert out["r"].delivered
    kept = (vt._starts, vt._finals, vt._delivered)
    assert all(len(d) <= 17 for d in kept) and all((0, 99) in d for d in kept)
    vt.on_speech_start(start(99))  # the latest utterance can still resume: its early reply was a false cut
    assert vt.false_cuts == 1


def test_a_final_that_differs_only_in_case_and_punctuation_takes_the_reply_ahead():
    """The prompt carries the words as a command is written: "Turn on the kitchen light." and "turn on the
    kitchen light" get the same reply, so the pause's is the final's."""
    clock, llm = Clock(), FakeLLM()
    vt = turn(llm, clock)
    vt.on_speech_start(start(0))
    vt.on_partial(AsrEvent("partial", 0, 0, "Turn on the kitchen light.", paused=True))
    assert vt.tick()
    reply(llm.handles[0], CALL, [10.10, 10.15])
    th, out = _run_final(vt, final(0, "turn on the kitchen light", decided=10.3), speech_end_s=10.0)
    th.join(10)  # the reply is there already: at once
    assert not th.is_alive() and len(llm.calls) == 1, "the final sent a request of its own"
    assert out["r"].reply_ahead and out["r"].delivered


class _WatchedLock:
    """A lock that says (``waiting``, and ``notify``) when a thread has to wait for it."""

    def __init__(self, notify) -> None:
        self._lock, self.waiting, self.notify = threading.Lock(), False, notify

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.waiting = True
            self.notify()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_a_final_that_comes_while_the_pause_s_reply_is_being_sent_takes_that_reply():
    """The pause's whole reply is being submitted (``tick`` on its thread) when the final on the same words
    arrives: the final waits until it is recorded and takes it; no second request."""
    clock, llm = Clock(), FakeLLM()
    release, entered = threading.Event(), threading.Event()
    plain = llm.__call__

    def slow_first(chat, params, tags=()):
        if not entered.is_set():  # the first submit (the pause's reply) is held until released
            entered.set()
            assert release.wait(10.0)
        return plain(chat, params, tags)

    vt = VoiceTurn(slow_first, TOOLS, clock=clock, tick_s=None)

    def notify():
        with llm.submitted:
            llm.submitted.notify_all()

    vt._sending = _WatchedLock(notify)
    vt.on_speech_start(start(0))
    vt.on_partial(AsrEvent("partial", 0, 0, "turn on the kitchen light", paused=True))
    ticker = threading.Thread(target=vt.tick, daemon=True)
    ticker.start()
    assert entered.wait(10.0)
    th, out = _run_final(vt, final(0, "turn on the kitchen light", decided=10.3), speech_end_s=10.0)
    with llm.submitted:  # the final either waits for the reply being sent or (wrongly) sends its own
        assert llm.submitted.wait_for(lambda: vt._sending.waiting or len(llm.calls) >= 1, 10.0)
    release.set()
    ticker.join(10)
    reply(llm.wait_for(1), CALL, [10.4, 10.5])
    th.join(10)
    assert len(llm.calls) == 1 and out["r"].reply_ahead and out["r"].delivered
