"""VoiceTurn on a real scheduler (demo-phi3-small, the home tools, greedy): the tool call for a final
transcript is the same with and without prefill ahead and with an early end; prefill ahead makes the
final's prompt a prefix-cache hit; a continued utterance yields exactly one call. Events are handed
over explicitly (tick() instead of a timer thread, a fake clock for stability)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.serving.asr.events import AsrEvent, UtteranceMetrics
from edge_agent.serving.doors.openai.output import load_tools
from edge_agent.serving.doors.voice.turn import VoiceTurn, chat_submit
from edge_agent.serving.llm.admission import INTERACTIVE
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

TEXT = "turn on the kitchen lights"
TOOLS = load_tools(Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models" / "home-tools.json")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model = DecoderLM.open(resolve_model("demo-phi3-small", tmp_path_factory.mktemp("m")), "onnxruntime")
    yield model
    model.close()


@pytest.fixture
def scheduler(lm):
    s = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0, prefix_cache_mb=64.0)).start()
    yield s
    s.stop()


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def final(utt: int, text: str, reason: str = "silence") -> AsrEvent:
    m = UtteranceMetrics(100.0, 5.0, 0.02, 1.0, 20.0, reason)
    return AsrEvent("final", 0, utt, text, text, 1.0, 0.0, m, 0.0)


def turn(scheduler, lm, clock, sent: list | None = None, **kw) -> VoiceTurn:
    """A VoiceTurn on ``scheduler``; each request it submits is appended to ``sent`` as (params, tags, handle)."""

    on_scheduler = chat_submit(scheduler, lm.tokenizer)

    def submit(chat, params, tags=()):
        handle = on_scheduler(chat, params, tags=tags)
        if sent is not None:
            sent.append((params, tags, handle))
        return handle

    return VoiceTurn(submit, TOOLS, clock=clock, tick_s=None, max_new_tokens=48, **kw)


def paused(utt: int, text: str) -> AsrEvent:
    return AsrEvent("partial", 0, utt, text, text, paused=True)


def test_the_call_is_the_same_with_and_without_prefill_ahead_and_early_end(scheduler, lm):
    clock = Clock()
    plain = turn(scheduler, lm, clock, prefill_ahead=False)
    base = plain.on_final(final(0, TEXT))
    plain.close()
    assert base.delivered and base.call is not None

    sent: list = []
    ahead = turn(scheduler, lm, clock, sent, stable_ms=120)
    ahead.on_event(AsrEvent("speech_start", 0, 1))
    ahead.on_event(AsrEvent("partial", 0, 1, "turn on the"))
    clock.t += 0.2
    assert ahead.tick()
    ahead.on_event(AsrEvent("partial", 0, 1, TEXT))
    clock.t += 0.2
    sent[-1][2].result(60.0)  # the first prefill is done: the next may go
    assert ahead.tick()
    sent[-1][2].result(60.0)
    assert [p.max_new_tokens for p, _, _ in sent] == [1, 1]
    early = ahead.on_final(final(1, TEXT, reason="early"))
    ahead.close()
    assert early.call == base.call and early.reply == base.reply
    assert early.early_end and early.prefill_ahead == 2 and early.prefill_wasted == 1
    # the final's whole prompt but its last token came from the cache, in whole blocks
    assert early.cached_tokens >= early.prompt_tokens - 16 > 0


def test_a_continued_utterance_cancels_the_early_reply_and_yields_one_call(scheduler, lm):
    clock = Clock()
    vt = turn(scheduler, lm, clock, prefill_ahead=False)
    vt.on_event(AsrEvent("speech_start", 0, 0))
    out: dict = {}
    th = threading.Thread(
        target=lambda: out.update(r=vt.on_final(final(0, "turn on the", reason="early"))), daemon=True
    )
    th.start()
    vt.on_event(AsrEvent("speech_start", 0, 0))  # the same utterance goes on (whenever the reply stands)
    th.join(120)
    second = vt.on_final(final(0, TEXT))
    vt.close()
    delivered = [r for r in (out["r"], second) if r.delivered]
    assert [r.text for r in delivered] == [TEXT]  # one call, the continued sentence's
    assert second.call is not None and vt.false_cuts + vt.cancelled == 1


def test_a_reply_started_on_a_pause_is_the_final_s_when_the_text_is_the_same(scheduler, lm):
    clock = Clock()
    base = turn(scheduler, lm, clock, prefill_ahead=False).on_final(final(0, TEXT))
    sent: list = []
    vt = turn(scheduler, lm, clock, sent)
    vt.on_event(AsrEvent("speech_start", 0, 1))
    vt.on_event(paused(1, TEXT))
    assert vt.tick()  # at once: no stable wait for a pause
    result = vt.on_final(final(1, TEXT, reason="early"))
    vt.close()
    assert len(sent) == 1 and sent[0][0].max_new_tokens == 48  # the whole reply went ahead; no second request
    assert result.reply_ahead and result.delivered
    assert result.reply == base.reply and result.call == base.call
    assert vt.replies_ahead == vt.replies_ahead_used == 1 and result.prefill_wasted == 0


def test_a_reply_ahead_on_other_words_is_cancelled_and_the_final_gets_its_own(scheduler, lm):
    """A pause, then more words: the reply ahead is not the final's; the final gets its own, the same as
    without any reply ahead, and the one ahead is cancelled (if it was still running)."""
    clock = Clock()
    base = turn(scheduler, lm, clock, prefill_ahead=False).on_final(final(0, TEXT))
    sent: list = []
    vt = turn(scheduler, lm, clock, sent)
    vt.on_event(AsrEvent("speech_start", 0, 1))
    vt.on_event(paused(1, "turn on the"))
    assert vt.tick()
    vt.on_event(AsrEvent("partial", 0, 1, "turn on the kitchen"))  # the speaker went on
    result = vt.on_final(final(1, TEXT))
    vt.close()
    assert sent[0][2].cancelled or sent[0][2].done  # retired by the final that read otherwise
    assert not result.reply_ahead and result.reply == base.reply and result.call == base.call
    assert sent[-1][1] == (INTERACTIVE,) and vt.replies_ahead == 1 and vt.replies_ahead_used == 0
    assert result.prefill_wasted == 1
