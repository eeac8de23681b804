"""`bench overload`'s pure parts: the seeded Poisson schedule, the accounting of every request, goodput and
percentiles against numpy, the medians over rounds, the targets and the table; the client against a local
server that refuses, fails, hangs and streams; the subcommand's help and a bad argument through the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from edge_agent.bench import overload as ov
from edge_agent.bench.overload_report import EDGE, LLAMA, cell, check_targets, format_report, table
from edge_agent.errors import InputError


def nearest_rank(values, p):
    """numpy's nearest-rank percentile (``inverted_cdf``), None for no values."""
    return None if len(values) == 0 else float(np.percentile(values, p, method="inverted_cdf"))


# -- the schedule -------------------------------------------------------------------------------------


def test_schedule_is_numpys_exponential_gaps_summed_and_cut_at_the_level_end() -> None:
    got = ov.poisson_schedule(2.5, 40.0, seed=7)
    gaps = np.random.default_rng(7).exponential(1 / 2.5, size=400)
    times = np.cumsum(gaps)
    assert got == pytest.approx(times[times < 40.0].tolist(), abs=0)
    assert got == ov.poisson_schedule(2.5, 40.0, seed=7)  # the same seed, the same arrivals
    assert got != ov.poisson_schedule(2.5, 40.0, seed=8)


def test_schedule_rate_over_a_long_horizon() -> None:
    rate, seconds = 3.0, 5000.0
    got = np.asarray(ov.poisson_schedule(rate, seconds, seed=1))
    n = got.size
    # a Poisson count has variance rate·seconds: within 4 standard deviations
    assert abs(n - rate * seconds) < 4 * np.sqrt(rate * seconds)
    assert np.all(np.diff(got) > 0) and got[0] >= 0 and got[-1] < seconds
    gaps = np.diff(got)
    # exponential gaps: mean 1/rate and coefficient of variation 1 (a fixed-interval schedule has 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_levels_get_their_own_seeds_the_same_for_every_system() -> None:
    seeds = {ov.level_seed(42, r, k) for r in range(3) for k in range(len(ov.LEVELS))}
    assert len(seeds) == 3 * len(ov.LEVELS)


@pytest.mark.parametrize(("rate", "seconds"), [(0.0, 10.0), (-1.0, 10.0), (1.0, 0.0)])
def test_schedule_refuses_a_rate_or_length_that_is_not_positive(rate: float, seconds: float) -> None:
    with pytest.raises(InputError, match="rate > 0 and seconds > 0"):
        ov.poisson_schedule(rate, seconds, seed=1)


# -- accounting and figures -------------------------------------------------------------------------------


def _outcomes(seed: int = 3, n: int = 200) -> list[ov.Outcome]:
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["completed", "refused", "cancelled", "failed"], size=n, p=[0.6, 0.3, 0.05, 0.05])
    out = []
    for i, kind in enumerate(kinds):
        t = float(i) / 10
        if kind == "completed":
            ttft = float(rng.lognormal(5.5, 0.8))
            out.append(ov.Outcome(t, "completed", ttft_ms=ttft, e2e_ms=ttft + 500, model="full" if i % 3 else "short"))
        elif kind == "refused":
            ra = None if i % 7 == 0 else "1"
            out.append(ov.Outcome(t, "refused", answered_ms=float(rng.uniform(2, 60)), status=429, retry_after=ra))
        else:
            out.append(ov.Outcome(t, str(kind)))
    return out


def test_every_request_is_accounted_and_an_unknown_kind_breaks_the_sum() -> None:
    outs = _outcomes()
    acc = ov.account(outs)
    assert acc["sent"] == len(outs) == acc["completed"] + acc["refused"] + acc["cancelled"] + acc["failed"]
    assert acc["accounted"] == 1
    assert ov.account([*outs, ov.Outcome(0.0, "lost")])["accounted"] == 0


def test_goodput_percentiles_and_refusals_against_numpy() -> None:
    outs = _outcomes()
    sla, seconds = 387.0, 20.0
    fig = ov.level_figures(outs, seconds, sla)
    ttft = np.array([o.ttft_ms for o in outs if o.kind == "completed"])
    refusals = np.array([o.answered_ms for o in outs if o.kind == "refused"])
    assert fig["goodput_per_s"] == pytest.approx(np.sum(ttft <= sla) / seconds)
    assert 0 < fig["goodput_per_s"] < fig["completed_per_s"]  # the lognormal puts some over the SLA
    for p in (50, 95, 99):
        assert fig[f"ttft_p{p}_ms"] == nearest_rank(ttft, p)
    for p in (50, 95):
        assert fig[f"refusal_p{p}_ms"] == nearest_rank(refusals, p)
    assert fig["refused_share"] == pytest.approx(refusals.size / len(outs))
    assert fig["refused_without_retry_after"] == sum(1 for o in outs if o.kind == "refused" and o.retry_after is None)
    assert sum(fig["served_by"].values()) == ttft.size


def test_a_chat_exactly_at_the_sla_is_good_one_just_over_is_not() -> None:
    outs = [ov.Outcome(0, "completed", ttft_ms=387.0), ov.Outcome(1, "completed", ttft_ms=387.01)]
    assert ov.goodput(outs, 2.0, 387.0) == 0.5


def test_voice_turns_percentiles_and_refusals() -> None:
    turns = [
        ov.VoiceTurn(
            float(i), "x", complete_ms=float(v), right=i % 2 == 0, final_ms=v / 2, first_token_ms=v - 40.0,
            reply_ahead=i < 5,
        )
        for i, v in enumerate(range(100, 1100, 50))
    ]  # fmt: skip
    turns.append(ov.VoiceTurn(30.0, "x", refused=True, error="overloaded"))
    fig = ov.level_figures([], 10.0, 387.0, turns)
    done = [t.complete_ms for t in turns if t.complete_ms is not None]
    assert fig["voice_p95_ms"] == nearest_rank(done, 95)
    assert fig["voice_final_p95_ms"] == nearest_rank(sorted(v / 2 for v in done), 95)
    assert fig["voice_first_token_p95_ms"] == nearest_rank(sorted(v - 40.0 for v in done), 95)
    assert fig["voice_replies_ahead"] == 5
    assert (fig["voice_turns"], fig["voice_refused"], fig["voice_right"]) == (21, 1, 10)
    assert fig["sent"] == 0 and fig["ttft_p95_ms"] is None and fig["refused_share"] is None


def _round(shift: float) -> list[dict]:
    rows = []
    for k, load in enumerate(ov.LEVELS):
        outs = _outcomes(seed=10 * k + int(shift))
        rows.append({"load": load, "offered_per_s": load * 2.0, **ov.level_figures(outs, 20.0, 387.0)})
    return rows


def test_combine_takes_medians_spreads_and_totals_over_rounds() -> None:
    rounds = [_round(0), _round(1), _round(2)]
    levels = ov.combine(rounds)
    assert [row["load"] for row in levels] == list(ov.LEVELS)
    for k, row in enumerate(levels):
        values = [r[k]["ttft_p95_ms"] for r in rounds]
        assert row["ttft_p95_ms"]["median"] == pytest.approx(float(np.median(values)))
        assert (row["ttft_p95_ms"]["min"], row["ttft_p95_ms"]["max"]) == (min(values), max(values))
        assert row["total_sent"] == sum(r[k]["sent"] for r in rounds)
        assert row["accounted"]


def test_spread_skips_rounds_that_measured_nothing() -> None:
    assert ov.spread([None, None]) is None
    assert ov.spread([None, 4.0, 2.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}


# -- targets and table --------------------------------------------------------------------------------


def _report(p95: float, refused_share: float, refusal_p95: float, g1: float, g3: float, switch_s: float = 3.0) -> dict:
    def stat(v):
        return {"median": v, "min": v, "max": v, "n": 3}

    levels = []
    for load in ov.LEVELS:
        levels.append({
            "load": load, "offered_per_s": load, "accounted": True,
            "total_sent": 10, "total_completed": 10, "total_refused": 0, "total_cancelled": 0, "total_failed": 0,
            "total_voice_turns": 4, "total_voice_refused": 0,
            "goodput_per_s": stat(g1 if load <= 2 else g3), "ttft_p50_ms": stat(100.0), "ttft_p95_ms": stat(p95),
            "ttft_p99_ms": stat(700.0), "refused_share": stat(refused_share if load == 1.5 else 0.0),
            "refusal_p50_ms": stat(5.0), "refusal_p95_ms": stat(refusal_p95), "voice_p95_ms": stat(450.0),
        })  # fmt: skip
    return {
        "sla_ms": 387.0, "capacity_per_s": 1.0, "capacity_measured_per_s": 1.0, "capacity_source": "measured",
        "rounds": 3, "seconds": 30.0, "seed": 42, "machine": {"cpu": "cpu", "cores": 2, "load_avg_at_start": [1.0]},
        "systems": {EDGE: {"levels": levels, "rounds": [[{"load": 0.5, "switch_delay_s": 1.0},
                                                        {"load": 1.5, "switch_delay_s": switch_s}]]}},
    }  # fmt: skip


def test_targets_met_at_their_bounds_and_missed_just_past_them() -> None:
    bound = (1 - 1 / 1.5) + 0.10
    met = {t["target"]: t["met"] for t in check_targets(_report(387.0, bound, 50.0, 1.0, 0.9))}
    assert all(met.values()), met
    missed = {t["target"]: t["met"] for t in check_targets(_report(387.5, bound + 0.001, 50.5, 1.0, 0.89, 3.1))}
    assert not missed["1.5x: admitted TTFT P95 <= 387 ms"]
    assert not missed["1.5x: refusals answered P95 <= 50 ms"]
    assert not missed["1.5x: refused share <= 43 % (1 - capacity/offered + 10 points)"]
    assert not missed["3x: goodput >= 0.9x goodput at 1x (ratio)"]
    assert missed["2x: goodput >= 0.9x goodput at 1x (ratio)"]
    assert not missed["a switch down <= 3 s after the first arrival predicted over budget (the slowest)"]


def test_table_has_a_row_per_level_and_as_many_cells_as_its_header() -> None:
    report = _report(300.0, 0.3, 20.0, 1.0, 1.0)
    report["systems"][LLAMA] = {"levels": report["systems"][EDGE]["levels"], "rounds": []}
    lines = table(report)
    assert len(lines) == 2 + len(ov.LEVELS)
    widths = {line.count("|") for line in lines}
    assert len(widths) == 1
    assert "| 1.5x |" in lines[2 + ov.LEVELS.index(1.5)]
    report["targets"] = check_targets(report)
    assert "| 1.5x: admitted TTFT P95 <= 387 ms | 300 ms | yes |" in format_report(report)


def test_cell_shows_the_spread_only_where_rounds_differ() -> None:
    assert cell(None) == "—"
    assert cell({"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}) == "2"
    assert cell({"median": 0.25, "min": 0.2, "max": 0.3, "n": 3}, 100) == "25 (20–30)"
    assert cell({"median": 1.234, "min": 1.0, "max": 1.5, "n": 1}, digits=2) == "1.23"


# -- the client against a local server ----------------------------------------------------------------------


def test_drive_level_accounts_refused_failed_cancelled_and_completed() -> None:
    from aiohttp import web

    hang = asyncio.Event()  # never set: that request waits until the drain cancels it

    async def chat(request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["messages"][0]["content"]
        if prompt == ov.CHAT_PROMPTS[0]:
            body = {"error": {"message": "over budget", "code": "overloaded"}}
            return web.json_response(body, status=429, headers={"Retry-After": "2"})
        if prompt == ov.CHAT_PROMPTS[1]:
            await hang.wait()
        if prompt == ov.CHAT_PROMPTS[3]:
            return web.json_response({"error": {"message": "boom", "code": "internal"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if prompt == ov.CHAT_PROMPTS[2]:
            await resp.write(b'data: {"error": {"message": "timed out", "code": "timeout"}}\n\n')
            return resp
        for chunk in ({"model": "full", "choices": [{"delta": {"role": "assistant"}}]},
                      {"model": "full", "choices": [{"delta": {"content": "Hi"}}]},
                      {"model": "full", "choices": [{"delta": {}, "finish_reason": "stop"}]},
                      {"model": "full", "choices": [], "usage": {"completion_tokens": 2}}):  # fmt: skip
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await ov.drive_level(f"http://127.0.0.1:{port}", [0.0, 0.01, 0.02, 0.03, 0.04, 0.05], 0.1, 0.5, None)
        finally:
            await runner.cleanup()

    outs, turns = asyncio.run(main())
    assert turns == []
    by_prompt = {i: o for i, o in enumerate(outs)}  # sorted by arrival: index i sent CHAT_PROMPTS[i]
    assert [o.kind for o in outs] == ["refused", "cancelled", "failed", "failed", "completed", "completed"]
    assert by_prompt[0].status == 429 and by_prompt[0].code == "overloaded" and by_prompt[0].retry_after == "2"
    assert by_prompt[0].message == "over budget"
    assert by_prompt[0].answered_ms is not None and by_prompt[0].answered_ms > 0
    assert by_prompt[2].code == "timeout" and by_prompt[3].status == 500
    assert by_prompt[4].model == "full" and by_prompt[4].tokens_out == 2
    assert 0 < by_prompt[4].ttft_ms <= by_prompt[4].e2e_ms
    assert ov.account(outs)["accounted"] == 1


# -- the command line ------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_agent", "bench", "overload", *args], capture_output=True, text=True, timeout=120
    )


def test_help_names_the_levels_and_the_options() -> None:
    got = _cli("--help")
    assert got.returncode == 0
    for flag in ("--seconds", "--rounds", "--capacity", "--out", "--llama-server", "--no-speech"):
        assert flag in got.stdout


def test_bad_arguments_are_one_line_errors_naming_the_option() -> None:
    short = _cli("--seconds", "2", "--out", "/tmp/never-written")
    assert short.returncode == 1
    assert short.stderr.strip().splitlines() == ["edge-agent: --seconds must be at least 5, got 2"]
    zero = _cli("--rounds", "0")
    assert zero.returncode == 2 and "--rounds must be > 0, got '0'" in zero.stderr


def test_resume_takes_the_earlier_schedule_and_refuses_what_is_not_a_report(tmp_path) -> None:
    from edge_agent.bench.options import OverloadOptions

    earlier = _report(300.0, 0.3, 20.0, 1.0, 1.0)
    earlier.update(capacity_per_s=0.8, seconds=20.0, rounds=2, seed=9)
    path = tmp_path / "overload.json"
    path.write_text(json.dumps(earlier))
    asked = OverloadOptions(resume=path, seconds=30.0, seed=42)
    report: dict = {"machine": {}}
    opts, kept = ov._resume(asked, report, lambda text: None)
    assert set(kept["systems"]) == {EDGE}
    assert (opts.seconds, opts.rounds, opts.seed) == (20.0, 2, 9)  # the same arrival times as the kept system's
    assert (asked.seconds, asked.rounds, asked.seed) == (30.0, None, 42)  # the caller's options are not changed
    fewer, _ = ov._resume(OverloadOptions(resume=path, rounds=1), {}, lambda text: None)
    assert (fewer.seconds, fewer.rounds, fewer.seed) == (20.0, 1, 9)  # fewer rounds, the same schedules
    assert report["capacity_per_s"] == 0.8 and report["machine_before"] == earlier["machine"]
    path.write_text('{"systems": {}}')
    with pytest.raises(InputError, match=r"--resume .*overload.json: not a bench overload report"):
        ov._resume(asked, {}, lambda text: None)


def test_combine_keeps_a_figure_the_first_round_did_not_measure() -> None:
    first = [{"load": 0.5, "offered_per_s": 1.0, "accounted": 1, "sent": 0, "refusal_p95_ms": None}]
    later = [{"load": 0.5, "offered_per_s": 1.0, "accounted": 1, "sent": 2, "refusal_p95_ms": 30.0}]
    (row,) = ov.combine([first, later, [{**later[0], "refusal_p95_ms": 50.0}]])
    assert row["refusal_p95_ms"] == {"median": 40.0, "min": 30.0, "max": 50.0, "n": 2}
    assert row["total_sent"] == 4


def test_switches_are_read_from_the_daemons_log_and_timed_from_the_first_refusal() -> None:
    import logging
    from datetime import datetime

    from edge_agent.logsetup import TEXT_FORMAT

    start = datetime(2026, 12, 6, 10, 8, 40).timestamp()

    def line(at_s: float, event: dict) -> str:
        msg = "event tier_switch: %s"
        record = logging.LogRecord("edge_agent.daemon.app", logging.INFO, "", 0, msg, (event,), None)
        record.created = start + at_s
        record.msecs = (record.created % 1) * 1000
        return logging.Formatter(TEXT_FORMAT).format(record)

    log = "\n".join(
        [
            line(-5.0, {"workload": "llm", "from": "short", "to": "full", "action": "upgrade"}),  # before the level
            line(8.36, {"workload": "llm", "from": "full", "to": "short", "action": "downgrade", "reason": "r"}),
            line(9.0, {"workload": "asr", "from": "a", "to": "b", "action": "downgrade"}),  # not the LLM's
            "2026-12-06 10:08:50,000 INFO edge_agent.daemon.app: serving: llm tier full",
        ]
    )
    got = ov.switches(log, start, start + 30)
    assert [(g["from"], g["to"], g["action"]) for g in got] == [("full", "short", "downgrade")]
    assert got[0]["t_s"] == pytest.approx(8.36, abs=0.002)  # the log keeps milliseconds
    outs = [ov.Outcome(2.0, "completed", ttft_ms=100.0), ov.Outcome(6.5, "refused"), ov.Outcome(7.0, "refused")]
    assert ov.switch_delay_s(outs, got) == pytest.approx(1.86, abs=0.002)
    assert ov.switch_delay_s(outs[:1], got) is None  # nothing over budget: nothing to time
