"""Admission's prediction and verdict (serving.tiers.admission), checked against hand-computed schedules."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.serving.tiers.admission import (
    LATENESS_MIN_SAMPLES,
    LATENESS_QUANTILE,
    PREFILL_MIN_TOKENS,
    STALE_S,
    Lateness,
    Rates,
    Snapshot,
    Work,
    judge,
    predict_ttft_ms,
)

RATES = Snapshot(step_ms=10.0, prefill_ms_per_token=0.5, mean_steps=None)


def test_an_idle_tier_gives_the_first_token_after_its_own_prefill():
    # one step of overhead plus 40 tokens at 0.5 ms
    assert predict_ttft_ms([], [], 40, rows=4, rates=RATES) == pytest.approx(10 + 20)


def test_fewer_ahead_than_free_rows_start_at_once_behind_their_prefills():
    ahead = [Work(20, 30), Work(20, 30)]  # each prefill: 10 + 10 ms
    # rows free: both ahead start now; this one waits only for their prefills (40 ms), then its own (20 ms)
    assert predict_ttft_ms([5], ahead, 20, rows=4, rates=RATES) == pytest.approx(40 + 20)


def test_a_full_batch_starts_the_request_when_the_soonest_row_frees():
    running = [50, 10, 30, 40]  # tokens left: rows free at 500, 100, 300, 400 ms
    assert predict_ttft_ms(running, [], 0, rows=4, rates=RATES) == pytest.approx(100)


def test_a_long_queue_costs_its_work_spread_over_the_rows():
    # 2 rows, both free at 0; 6 requests ahead of 0 prompt tokens and 10 tokens (100 ms) each: they run in
    # three waves, so this one starts at 300 ms
    ahead = [Work(0, 10)] * 6
    assert predict_ttft_ms([], ahead, 0, rows=2, rates=RATES) == pytest.approx(300)


def test_only_the_rows_a_class_may_use_count():
    # 3 rows running; chats may use 2 of them (one kept for voice): the soonest two decide
    assert predict_ttft_ms([10, 20, 30], [], 0, rows=2, rates=RATES) == pytest.approx(100)


def test_expected_steps_follow_what_requests_really_take():
    snap = Snapshot(10.0, 0.0, mean_steps=40)
    assert snap.expected_new(128) == 40
    assert snap.expected_new(16) == 16  # never past the cap
    assert snap.expected_new(128, taken=30) == 10
    assert snap.expected_new(128, taken=60) == 10  # past the mean: a quarter of it at least
    assert Snapshot(10.0, 0.0).expected_new(128, taken=28) == 100  # no mean yet: its cap


def test_voice_replies_are_expected_to_take_what_voice_replies_take():
    """A tool call takes a few steps (its format forces most tokens), a chat dozens: each class its own mean;
    a voice reply with nothing learnt yet counts as a chat."""
    assert Snapshot(10.0, 0.0, mean_steps=40).expected_new(160, voice=True) == 40
    snap = Snapshot(10.0, 0.0, mean_steps=40, mean_voice_steps=6)
    assert snap.expected_new(160, voice=True) == 6 and snap.expected_new(160) == 40
    assert snap.expected_new(160, taken=4, voice=True) == 2
    rates = Rates()
    rates.step(10.0, 0.0)
    rates.finished(40, 0.0)
    rates.finished(6, 0.0, voice=True)
    rates.finished(1, 0.0, capped=True, voice=True)  # a prefill ahead (one token): says nothing against 6
    snap = rates.snapshot(0.0)
    assert (snap.mean_steps, snap.mean_voice_steps) == (40, 6)


def test_judge_admits_within_the_budget_and_refuses_with_a_retry_hint():
    assert judge(None, 387).admit  # nothing known: nothing says it would be late
    assert judge(387, 387).admit
    refused = judge(2_600, 387, "chat")
    assert not refused.admit and refused.retry_after_s == 3  # 2.213 s over, in whole seconds
    assert "2600 ms" in refused.reason and "387 ms" in refused.reason
    assert judge(400, 387).retry_after_s == 1


def test_seeded_rates_serve_until_the_first_real_samples_replace_them():
    rates = Rates()
    rates.seed(20.0, 64, 84.0, 0.0)  # at load: a 20 ms step, a 64-token prefill in 84 ms (1 ms a token)
    assert rates.snapshot(0.0) == Snapshot(20.0, pytest.approx(1.0), None)
    rates.step(30.0, 1.0)  # replaced, not averaged: the load-time timing was one sample
    rates.prefill(100, 230.0, 1.0)
    assert rates.snapshot(1.0) == Snapshot(30.0, pytest.approx(2.0), None)
    rates.step(40.0, 2.0)  # real samples average as before
    assert rates.snapshot(2.0).step_ms == pytest.approx(32.0)
    short = Rates()
    short.seed(20.0, PREFILL_MIN_TOKENS - 1, 500.0, 0.0)  # too short a prefill to seed a per-token rate
    assert short.snapshot(0.0) == Snapshot(20.0, 0.0, None)


def test_a_request_stopped_by_its_cap_never_lowers_the_expected_length():
    rates = Rates()
    rates.step(10.0, 0.0)
    rates.finished(8, 0.0, capped=True)  # it wanted at least 8: no length is known yet
    assert rates.snapshot(0.0).mean_steps is None
    rates.finished(30, 0.0)
    rates.finished(8, 0.0, capped=True)  # at least 8 says nothing against a mean of 30
    assert rates.snapshot(0.0).mean_steps == 30
    rates.finished(80, 0.0, capped=True)  # at least 80 raises it
    assert rates.snapshot(0.0).mean_steps == pytest.approx(30 + 0.2 * 50)


def test_rates_learn_steps_prefills_and_lengths_and_age_out():
    rates = Rates()
    assert rates.snapshot(0.0) is None
    rates.step(20.0, 0.0)
    assert rates.snapshot(0.0) == Snapshot(20.0, 0.0, None)  # no prefill rate yet: a prefill costs one step
    rates.prefill(PREFILL_MIN_TOKENS - 1, 500.0, 0.0)  # too short to say anything per token
    assert rates.snapshot(0.0).prefill_ms_per_token == 0.0
    rates.prefill(100, 120.0, 0.0)  # 20 ms is the call, 100 ms the tokens
    assert rates.snapshot(0.0).prefill_ms_per_token == pytest.approx(1.0)
    rates.step(30.0, 1.0)
    assert rates.snapshot(1.0).step_ms == pytest.approx(22.0)  # weighted towards the older value
    rates.finished(48, 1.0)
    assert rates.snapshot(1.0).mean_steps == 48
    assert rates.snapshot(1.0 + STALE_S + 1) is None  # stale: the device may have changed
    rates.step(50.0, 2.0 + STALE_S)
    assert rates.snapshot(2.0 + STALE_S).step_ms == 50.0  # replaced, not averaged with a stale value


def test_lateness_is_the_95th_percentile_of_recent_late_first_tokens_while_few_arrivals_are_known():
    late = Lateness()
    for _ in range(LATENESS_MIN_SAMPLES - 1):
        late.observe(10.0, 10.5)  # 500 ms late each
    assert late.margin_ms(11.0, 387) == 0.0  # too few to say anything
    late = Lateness()
    errors_ms = [-40, *range(0, 170, 10), 200, 900]  # 20 first tokens: one of twenty very late
    for ms in errors_ms:
        late.observe(100.0, 100.0 + ms / 1e3)
    # nearest rank: the 19th of 20 sorted, 200 ms: the one outlier in twenty is not covered
    assert late.margin_ms(100.5, 387) == pytest.approx(200.0)
    assert late.margin_ms(100.0 + STALE_S + 1, 387) == 0.0  # aged out: the device may have changed
    early = Lateness()
    for _ in range(10):
        early.observe(5.0, 4.9)
    assert early.margin_ms(5.0, 387) == 0.0  # starting early is never a negative margin


def _margin_by_search(predicted, errors, budget):
    """The reference: the smallest margin, tried in 1 ms steps, whose admitted arrivals (prediction + margin
    within the budget) paired with every error are late over the budget in at most 5 % of the pairs more than
    the soonest arrival is (its pairs' late share: lateness no refusal cures)."""
    soonest = sum(min(predicted) + e > budget for e in errors) / len(errors)
    for margin in range(0, int(budget) + 1):
        admitted = [p for p in predicted if p + margin <= budget]
        pairs = [p + e for p in admitted for e in errors]
        if sum(t > budget for t in pairs) / len(pairs) - soonest <= 1 - LATENESS_QUANTILE + 1e-12:
            return margin
    raise AssertionError("the soonest arrival alone always fits")


@pytest.mark.parametrize("seed", range(6))
def test_lateness_admits_what_a_search_over_margins_admits(seed):
    rng = np.random.default_rng(seed)
    budget = 387.0
    # arrivals: most predicted soon (an idle row), some behind a queue; errors: mostly small, a late tail
    predicted = np.round(np.where(rng.random(64) < 0.6, rng.uniform(60, 200, 64), rng.uniform(200, 3000, 64)), 1)
    errors = np.round(np.where(rng.random(32) < 0.97, rng.normal(60, 60, 32), rng.uniform(300, 900, 32)), 1)
    late = Lateness()
    for i, ms in enumerate(predicted):
        late.arrived(float(ms), 100.0 + i * 0.01)
    for ms in errors:
        late.observe(101.0, 101.0 + ms / 1e3)
    margin = late.margin_ms(102.0, budget)
    reference = _margin_by_search(predicted.tolist(), errors.tolist(), budget)
    covering = max(0.0, np.sort(errors)[int(np.ceil(LATENESS_QUANTILE * len(errors))) - 1])
    # the same arrivals admitted: the margin lies between the last admitted prediction and the first refused
    assert sorted(p for p in predicted if p + margin <= budget) == sorted(
        p for p in predicted if p + reference <= budget
    )
    assert margin <= covering


def test_lateness_is_nothing_when_every_recent_arrival_would_be_on_time_or_late_whatever_it_waited():
    on_time = Lateness()
    for i in range(20):
        on_time.arrived(100.0, 1.0)
        on_time.observe(1.0, 1.0 + (50 + i) / 1e3)  # 50-69 ms late: 169 ms at most, well inside 387
    assert on_time.margin_ms(1.5, 387) == 0.0
    hopeless = Lateness()
    for i in range(20):
        hopeless.arrived(100.0 + i, 1.0)
        hopeless.observe(1.0, 1.0 + (400 + i) / 1e3)  # even the soonest arrival is late every time
    assert hopeless.margin_ms(1.5, 387) == 0.0  # refusing more would not make anyone sooner
    assert hopeless.margin_ms(1.5 + STALE_S + 1, 387) == 0.0  # all aged out


def test_lateness_keeps_admitted_first_tokens_within_the_budget_where_covering_every_error_refuses_more():
    """A simulated box: arrivals' predictions and their real first-token times (the prediction plus an error
    drawn from one distribution: an unmodelled pass on the same cores makes one in thirty 300-700 ms late).
    Admission with the margin, learnt from the last arrivals and errors as the scheduler feeds it, keeps
    the admitted first tokens within the budget near 95 % and admits a quarter more than the errors' own 95th
    percentile as a margin would."""
    rng = np.random.default_rng(7)
    budget, n = 387.0, 4000
    predicted = np.where(rng.random(n) < 0.5, rng.uniform(50, 250, n), rng.uniform(250, 2500, n))
    errors = np.where(rng.random(n) < 29 / 30, rng.normal(60, 60, n), rng.uniform(300, 700, n))
    late, ttft, admitted_covering = Lateness(), [], 0
    for i in range(n):
        now = i * 0.05
        late.arrived(float(predicted[i]), now)
        if predicted[i] + late.margin_ms(now, budget) <= budget:
            ttft.append(predicted[i] + errors[i])
            late.observe(now + predicted[i] / 1e3, now + ttft[-1] / 1e3)
        admitted_covering += predicted[i] + np.quantile(errors, LATENESS_QUANTILE) <= budget
    assert np.mean(np.array(ttft) <= budget) >= LATENESS_QUANTILE - 0.02
    assert len(ttft) >= 1.25 * admitted_covering


def test_judge_adds_the_margin_and_says_so():
    assert judge(300, 387).admit
    refused = judge(300, 387, "chat", margin_ms=150)
    assert not refused.admit and refused.retry_after_s == 1
    assert "450 ms" in refused.reason and "150 ms of recent lateness" in refused.reason
    assert judge(None, 387, margin_ms=10_000).admit  # nothing predicted: still nothing says it would be late
