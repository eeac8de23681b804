"""Tier switching on real demo models whose sessions get a settable extra latency.

The controller sees a slow top tier, moves down while a client keeps sending requests, and no request
fails; a pin overrides it; a tier that cannot load leaves serving where it was."""

from __future__ import annotations

import threading
import time

import pytest

from edge_agent.backends import SessionOptions
from edge_agent.errors import ModelError, Overloaded
from edge_agent.models.catalog import resolve_model
from edge_agent.models.grammar import json_schema_grammar
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import Policy


class SlowSession:
    """A real session with extra latency per call, settable while it runs."""

    def __init__(self, inner, extra_ms: float) -> None:
        self.inner, self.extra_ms = inner, extra_ms
        self.inputs, self.outputs = inner.inputs, inner.outputs

    def run(self, feeds, output_names=None):
        time.sleep(self.extra_ms / 1e3)
        return self.inner.run(feeds, output_names)

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


class Ladder:
    """Two tiers of demo-phi3; counts models in memory at once."""

    def __init__(self, cache, heavy_ms: float, light_ms: float = 0.0, light_fails: bool = False) -> None:
        self.loaded = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.sessions: dict[str, SlowSession] = {}
        limits = Limits(max_batch=2, batch_timeout_ms=0)
        self.tiers = [
            Tier("heavy", lambda: self._open(cache, "heavy", heavy_ms), limits, 8),
            Tier("light", lambda: self._open(cache, "light", light_ms, light_fails), limits, 8),
        ]

    def _open(self, cache, name, extra_ms, fail=False):
        if fail:
            raise ModelError("light: model.onnx is truncated")
        lm = DecoderLM.open(resolve_model("demo-phi3", cache), "onnxruntime", SessionOptions(threads=1))
        lm.session = self.sessions[name] = SlowSession(lm.session, extra_ms)
        with self.lock:
            self.loaded += 1
            self.peak = max(self.peak, self.loaded)
        close = lm.close

        def closing():
            with self.lock:
                self.loaded -= 1
            close()

        lm.close = closing
        return lm


POLICY = Policy(
    metric="ttft_ms",
    percentile=95,
    target_ms=40.0,
    min_samples=4,
    downgrade_after=2,
    upgrade_after=2,
    upgrade_ratio=0.7,
    cooldown_s=0.0,
    min_dwell_s=0.0,
)


def build(ladder, policy=POLICY):
    events = []
    holder = {}
    served = TieredLLM(
        ladder.tiers,
        observe=lambda obs: holder["c"].observe(obs),
        on_switched=lambda old, new, ms, err: err and holder["c"].switch_failed(old, new, err),
    )
    served.start()
    controller = holder["c"] = TierController(
        served,
        policy,
        window_s=30.0,
        evaluate_every_s=3600,
        on_event=lambda kind, payload: events.append((kind, payload)),
    )
    return served, controller, events


def client(served, stop, results, errors):
    while not stop.is_set():
        try:
            results.append(served.submit("hello there", SamplingParams(max_new_tokens=6, temperature=0)).result(30))
        except Overloaded:
            time.sleep(0.01)
        except Exception as exc:  # any other failure is a test failure
            errors.append(exc)
            return


def test_slow_top_tier_moves_down_without_failing_a_request(cache):
    ladder = Ladder(cache, heavy_ms=25.0)  # every run +25 ms: TTFT well over 40 ms
    served, controller, events = build(ladder)
    stop, results, errors = threading.Event(), [], []
    threads = [threading.Thread(target=client, args=(served, stop, results, errors), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while served.active == 0 and time.monotonic() < deadline:
            time.sleep(0.3)
            controller.evaluate()
        served.wait_switched(60)
        before = len(results)
        while len(results) < before + 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert served.active == 1
    kinds = [k for k, _ in events]
    assert kinds.count("tier_switch") == 1
    switch = events[kinds.index("tier_switch")][1]
    assert switch["from"] == "heavy" and switch["to"] == "light" and switch["action"] == "downgrade"
    assert switch["snapshot"]["value_ms"] > 40.0 and switch["snapshot"]["count"] >= 4
    assert "target 40" in switch["reason"]
    assert ladder.peak == 2 and ladder.loaded == 1  # old tier drained and closed; never three in memory
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)
    after = served.submit("after the switch", SamplingParams(max_new_tokens=3, temperature=0))
    assert after.result(30).token_ids and after.tier == "light"  # the tier that served it, typed
    served.stop()


def test_fast_light_tier_moves_back_up_and_a_pin_overrides(cache):
    ladder = Ladder(cache, heavy_ms=0.0)
    served, controller, events = build(ladder)
    try:
        controller.pin("light")
        served.wait_switched(60)
        assert served.active == 1 and events[-1][1]["action"] == "pin"
        for _ in range(6):  # fast responses: without the pin this would move up
            served.submit("hi", SamplingParams(max_new_tokens=3, temperature=0)).result(30)
        for _ in range(3):
            assert controller.evaluate().action == "hold"
        assert served.active == 1
        controller.unpin()
        for _ in range(3):
            controller.evaluate()
        served.wait_switched(60)
        assert served.active == 0 and events[-1][1]["action"] == "upgrade"
        with pytest.raises(ValueError, match="unknown tier 'nope'"):
            controller.pin("nope")
    finally:
        served.stop()


def test_a_tier_that_cannot_load_leaves_serving_on_the_current_one(cache):
    ladder = Ladder(cache, heavy_ms=50.0, light_fails=True)
    served, controller, events = build(ladder)
    try:
        for _ in range(6):
            served.submit("hi", SamplingParams(max_new_tokens=3, temperature=0)).result(30)
        controller.evaluate()
        controller.evaluate()
        served.wait_switched(60)
        assert served.active == 0 and controller.state.tier == 0
        failed = [p for k, p in events if k == "tier_switch_failed"]
        assert failed and "truncated" in failed[0]["error"]
        assert served.submit("still here", SamplingParams(max_new_tokens=3, temperature=0)).result(30).token_ids
    finally:
        served.stop()


def test_shedding_and_truncation_at_the_lightest_tier(cache):
    ladder = Ladder(cache, heavy_ms=0.0)
    served, controller, _ = build(ladder)
    try:
        served.token_cap_ratio = 0.5
        done = served.submit("hi", SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)).result(30)
        assert len(done.token_ids) == 4  # the tier's max_new_tokens 8 × 0.5
        # a reply whose format a grammar fixes keeps the tier's whole cap: cut short it would not parse
        longer = json_schema_grammar({"enum": ["the quick brown fox jumps over the lazy dog and the cat"]})
        fixed = SamplingParams(max_new_tokens=100, temperature=0, grammar=longer)
        assert len(served.submit("hi", fixed).result(30).token_ids) == 8
        served.shedding = True
        with pytest.raises(Overloaded, match="shedding load"):
            served.submit("hi", SamplingParams(max_new_tokens=3))
    finally:
        served.stop()


def test_a_request_caught_by_a_switch_while_tokenizing_is_served_by_the_new_tier(cache):
    """The switch retires the tier a request picked before the request reaches its scheduler: the request
    goes to the new tier instead of failing with the old scheduler's 'shutting down'."""
    ladder = Ladder(cache, heavy_ms=0.0)
    served = TieredLLM(ladder.tiers)
    served.start()
    try:
        tok = served._active.lm.tokenizer
        raced = []

        def switch_first(encode):
            def encode_during_a_switch(*args, **kwargs):
                if not raced:
                    raced.append(True)
                    assert served.switch_to(1)
                    served.wait_switched()  # the heavy tier's scheduler is stopped by now
                return encode(*args, **kwargs)

            return encode_during_a_switch

        tok.encode, tok.encode_chat = switch_first(tok.encode), switch_first(tok.encode_chat)
        handle = served.submit("hello there", SamplingParams(max_new_tokens=4, temperature=0))
        result = handle.result(30)
        assert raced and handle.tier == "light" and served.active_tier == "light"
        assert len(result.token_ids) == 4
    finally:
        served.stop(5)
