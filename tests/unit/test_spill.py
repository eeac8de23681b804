"""The spill decision beside a one-sequence tier (``serving.llm.spill``), the first-token threshold each SLA
gives it (``Policy.spill_threshold_ms``), and the warm-ups' place: routed as their reply, out of /metrics.
Times are given, never measured."""

from __future__ import annotations

import asyncio

import pytest

from edge_agent.config.sla import SlaConfig
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.metrics.timing import RequestTiming
from edge_agent.metrics.window import WARMUP
from edge_agent.models.sampling import SamplingParams
from edge_agent.observe import Observation
from edge_agent.serving.doors.host import Mailbox
from edge_agent.serving.doors.http.voice_session import VoiceSession
from edge_agent.serving.llm.spill import decide
from edge_agent.serving.tiers.admission import STALE_S, Rates, Snapshot, Work, predict_ttft_ms
from edge_agent.serving.tiers.policy import DEFAULT_SPILL_TTFT_MS, overlay, policy_from_config
from edge_agent.telemetry.schema import SlaSpec


def _timing(
    finished_s: float, tokens_in: int, prefill_ms: float, decode_ms: float, tokens: int, tags=()
) -> RequestTiming:
    """A request admitted and scheduled at ``finished_s`` minus its own time, with even token gaps."""
    total = (prefill_ms + decode_ms * (tokens - 1)) / 1e3
    start = finished_s - total
    first = start + prefill_ms / 1e3
    times = tuple(first + i * decode_ms / 1e3 for i in range(tokens))
    return RequestTiming(start, start, times, max(finished_s, times[-1]), tokens_in=tokens_in, tags=frozenset(tags))


def _rates(step_ms: float, prompt_tokens: int, prefill_ms: float, at: float = 10.0) -> Snapshot:
    rates = Rates()
    rates.step(step_ms, at)
    rates.prefill(prompt_tokens, prefill_ms, at)
    snap = rates.snapshot(at)
    assert snap is not None
    return snap


def test_an_idle_tier_takes_every_request_whatever_its_last_request_cost() -> None:
    assert decide(0, 921.0, 387.0).take  # one slow first token predicted: an idle tier still takes it


def test_a_busy_tier_is_judged_by_its_predicted_first_token() -> None:
    rates = _rates(10.0, 100, 210.0)  # 10 ms a step; a 100-token prefill took a step + 2 ms a token
    assert rates.prefill_ms_per_token == pytest.approx(2.0)
    # one sequence decoding with 20 tokens left, one waiting (50 prompt tokens, 8 to generate), one row:
    # the row frees at 200 ms; the waiting one holds it for 10 + 50 x 2 + 8 x 10 = 190 ms; then this
    # request's prefill, 10 + 30 x 2 = 70 ms: 460 ms
    predicted = predict_ttft_ms([20], [Work(50, 8)], 30, 1, rates)
    assert predicted == pytest.approx(460.0)
    verdict = decide(2, predicted, 387.0)
    assert not verdict.take and verdict.expected_ms == pytest.approx(460.0)
    assert verdict.reason == "queue: expected first token in 460 ms > 387 ms"
    assert decide(2, predicted, 500.0).take
    assert decide(2, predicted, None).take  # no threshold: it queues


def test_a_short_prompt_is_not_judged_by_a_long_prompts_first_token() -> None:
    rates = _rates(10.0, 380, 921.0)
    predicted = predict_ttft_ms([1], [], 20, 1, rates)
    assert predicted == pytest.approx(10.0 + 10.0 + 20 * (921.0 - 10.0) / 380)
    assert decide(1, predicted, 387.0).take


def test_a_busy_tier_without_recent_rates_hands_the_request_on() -> None:
    rates = Rates()
    rates.step(10.0, 10.0)
    assert rates.snapshot(10.0 + STALE_S) is not None
    assert rates.snapshot(10.0 + STALE_S + 1) is None  # aged out: nothing to predict with
    verdict = decide(1, None, 387.0)
    assert not verdict.take and verdict.reason == "queue: 1 request(s) ahead and no recent timing to wait on"


@pytest.mark.parametrize(
    ("sla", "expected"),
    [
        ({"metric": "ttft_ms", "target_ms": 220}, 220.0),
        ({"metric": "e2e_ms", "target_ms": 2000}, 2000.0),
        ({"metric": "itl_ms", "target_ms": 50}, DEFAULT_SPILL_TTFT_MS),
        ({"metric": "tpot_ms", "target_ms": 50}, DEFAULT_SPILL_TTFT_MS),
        ({"metric": "itl_ms", "target_ms": 50, "spill_ttft_ms": 600}, 600.0),
        ({"metric": "ttft_ms", "target_ms": 220, "spill_ttft_ms": 300}, 300.0),
    ],
)
def test_the_spill_threshold_is_a_first_token_time_for_every_sla_metric(sla: dict, expected: float) -> None:
    assert policy_from_config(SlaConfig(**sla), 4).spill_threshold_ms == expected


def test_a_fleet_sla_moves_the_derived_threshold_with_it() -> None:
    policy = policy_from_config(SlaConfig(metric="ttft_ms", target_ms=387), 4)
    assert overlay(policy, SlaSpec(metric="ttft_ms", target_ms=5000)).spill_threshold_ms == 5000.0
    assert overlay(policy, SlaSpec(metric="itl_ms", target_ms=50)).spill_threshold_ms == DEFAULT_SPILL_TTFT_MS


def test_a_warm_up_is_left_out_of_the_prometheus_metrics() -> None:
    metrics = PrometheusMetrics()
    metrics.observe(Observation.of_request(_timing(1.0, 10, 5.0, 1.0, 1, tags=(WARMUP,)), "npu", "m"))
    metrics.observe(Observation.of_request(_timing(2.0, 10, 5.0, 1.0, 3), "npu", "m"))
    text = metrics.render().decode()
    counts = [x for x in text.splitlines() if x.startswith("edge_agent:request_success_total{")]
    assert counts == ['edge_agent:request_success_total{tier="npu",workload="llm"} 1.0']


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def submit(self, chat, params, tags=(), route_new_tokens=None):
        self.calls.append({"tags": tags, "max_new_tokens": params.max_new_tokens, "route": route_new_tokens})


def test_a_voice_sessions_prefill_ahead_is_routed_as_its_reply() -> None:
    llm, loop = _Recorder(), asyncio.new_event_loop()
    try:
        session = VoiceSession(llm, Mailbox(loop), {"tick_s": None})
        session.configure('{"max_tokens": 300}')
        session._submit([], SamplingParams(max_new_tokens=1), tags=(WARMUP,))
    finally:
        session.turn.close()
        loop.close()
    assert llm.calls == [{"tags": (WARMUP,), "max_new_tokens": 1, "route": 300}]
