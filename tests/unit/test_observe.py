"""The observation record and its fan-out: what each consumer (Prometheus, the tier controller, the
telemetry window) receives from one LLM request or ASR utterance."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.metrics.timing import RequestTiming
from edge_agent.metrics.window import FIRST_AFTER_LOAD, WARMUP
from edge_agent.observe import Observation, Observers
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import Policy


def timing(tags=frozenset()) -> RequestTiming:
    # admitted 0, scheduled 10 ms, tokens at 50/60/80 ms, finished 90 ms
    return RequestTiming(0.0, 0.010, (0.050, 0.060, 0.080), 0.090, tokens_in=7, tags=tags)


def test_a_request_timeline_becomes_typed_samples():
    obs = Observation.of_request(timing(), "small", "demo-phi3")
    assert (obs.workload, obs.tier, obs.model, obs.engine) == ("llm", "small", "demo-phi3", None)
    assert obs.samples["ttft_ms"] == pytest.approx((50.0,))
    assert obs.samples["itl_ms"] == pytest.approx((10.0, 20.0))
    assert obs.samples["tpot_ms"] == pytest.approx((20.0,))  # (e2e 90 - ttft 50) / (3 - 1)
    assert obs.samples["queue_ms"] == pytest.approx((10.0,)) and obs.samples["e2e_ms"] == pytest.approx((90.0,))
    assert (obs.tokens_in, obs.tokens_out, obs.first_after_load, obs.tags) == (7, 3, False, ())


@pytest.mark.parametrize("tag", [FIRST_AFTER_LOAD, WARMUP])
def test_first_after_load_and_warm_up_are_flagged(tag):
    obs = Observation.of_request(timing(frozenset({tag})), "small", "m")
    assert obs.first_after_load and obs.tags == (FIRST_AFTER_LOAD,)


def test_a_request_without_tokens_has_no_empty_metrics():
    obs = Observation.of_request(RequestTiming(0.0, None, (), 0.5), "small", "m")
    assert set(obs.samples) == {"e2e_ms"}


def test_deliver_reaches_every_observer_even_past_one_that_raises(caplog):
    seen: list[tuple[str, Observation]] = []
    observers = Observers()
    observers.register(lambda o: seen.append(("first", o)))
    observers.register(lambda o: 1 / 0)
    observers.register(lambda o: seen.append(("third", o)))
    obs = Observation("asr", "ctc", "demo-asr", {"final_ms": (40.0,)})
    with caplog.at_level(logging.ERROR):
        observers.deliver(obs)
    assert seen == [("first", obs), ("third", obs)]
    assert "asr observer" in caplog.text and "ZeroDivisionError" in caplog.text


def test_prometheus_labels_by_the_observations_tier():
    metrics = PrometheusMetrics()
    metrics.observe(Observation.of_request(timing(), "small", "m"))
    metrics.observe(Observation("asr", "ctc", "m", {"first_partial_ms": (120.0,), "final_ms": (80.0,)}))
    text = metrics.render().decode()
    assert 'edge_agent:e2e_request_latency_seconds_count{tier="small",workload="llm"} 1.0' in text
    assert 'edge_agent:inter_token_latency_seconds_count{tier="small",workload="llm"} 2.0' in text
    assert 'edge_agent:prompt_tokens_total{tier="small",workload="llm"} 7.0' in text
    assert 'edge_agent:asr_first_partial_seconds_sum{tier="ctc"} 0.12' in text
    assert 'edge_agent:asr_final_seconds_count{tier="ctc"} 1.0' in text


def test_the_controller_keeps_its_workloads_active_tier_and_leaves_first_after_load_out_of_the_window():
    ladder = SimpleNamespace(
        tiers=[SimpleNamespace(name="heavy"), SimpleNamespace(name="light")],
        active=0,
        switching=False,
        shedding=False,
        token_cap_ratio=1.0,
    )
    now = [0.0]
    controller = TierController(ladder, Policy(metric="ttft_ms"), window_s=60.0, clock=lambda: now[0])
    controller.observe(Observation.of_request(timing(), "heavy", "m"))
    controller.observe(Observation.of_request(timing(frozenset({FIRST_AFTER_LOAD})), "heavy", "m"))
    controller.observe(Observation.of_request(timing(), "light", "m"))  # a draining tier
    controller.observe(Observation("asr", "heavy", "m", {"ttft_ms": (1.0,)}))  # another workload
    assert controller.window.values("ttft_ms", 0.0) == pytest.approx([50.0])
    assert controller.window.count("requests", 0.0) == 2  # throughput counts the first-after-load one


def test_telemetry_leaves_first_after_load_out_and_keeps_the_rest():
    from edge_agent.telemetry.service import Telemetry
    from edge_agent.telemetry.windows import WindowAccumulator

    tele = SimpleNamespace(accumulator=WindowAccumulator())
    Telemetry.observe(tele, Observation.of_request(timing(frozenset({FIRST_AFTER_LOAD})), "small", "m"))
    Telemetry.observe(tele, Observation.of_request(timing(), "small", "m"))
    Telemetry.observe(tele, Observation("asr", "ctc", "demo-asr", {"final_ms": (80.0,)}))
    series = {(s.workload, s.tier): s for s in tele.accumulator.take()}
    assert series[("llm", "small")].requests == 1 and series[("llm", "small")].tokens_out == 3
    assert series[("llm", "small")].samples["ttft_ms"] == pytest.approx([50.0])
    assert series[("asr", "ctc")].model == "demo-asr" and series[("asr", "ctc")].samples["final_ms"] == [80.0]
