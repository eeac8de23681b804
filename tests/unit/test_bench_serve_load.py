"""`bench serve`'s closed loop: clients start k·ramp/C apart (equal requests otherwise arrive in
lockstep), and the levels above C=1 are compared with the C=1 level of the same run."""

from __future__ import annotations

import asyncio
import time

import pytest

from edge_agent.bench import serve_client
from edge_agent.bench.serve_client import Load, RequestResult
from edge_agent.bench.serve_report import against_c1


def _starts(monkeypatch, concurrency: int, ramp_s: float, requests: int) -> list[float]:
    starts: list[float] = []

    async def fake_stream(session, target, body) -> RequestResult:
        starts.append(time.perf_counter())
        await asyncio.sleep(0.5)  # longer than the ramp: each client's first request is one of the four
        return RequestResult(ok=True, status="200")

    monkeypatch.setattr(serve_client, "chat_stream", fake_stream)
    load = Load(None, None, lambda i: {}, requests, None)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    asyncio.run(load.closed(concurrency, ramp_s))
    assert len(load.results) == requests
    return [s - t0 for s in starts]


def test_clients_start_a_ramp_apart(monkeypatch) -> None:
    first = _starts(monkeypatch, 4, 0.24, 4)
    # client k at k · 0.24 / 4 s: never before it (a sleep may end late, not early), never long after
    assert all(k * 0.06 - 0.002 <= t < k * 0.06 + 0.15 for k, t in enumerate(first)), first


def test_without_a_ramp_all_clients_start_at_once(monkeypatch) -> None:
    first = _starts(monkeypatch, 4, 0.0, 4)
    assert max(first) - min(first) < 0.055


def _level(c: int, ttft_p50: float, itl_p50: float, tps: float, mode: str = "closed") -> dict:
    return {
        "mode": mode,
        "concurrency": c,
        "client": {"ttft_ms": {"p50": ttft_p50}, "itl_ms": {"p50": itl_p50}, "tokens_per_s": tps},
    }


def test_levels_above_c1_carry_their_ratios_to_it() -> None:
    levels = [_level(1, 20.0, 4.0, 200.0), _level(4, 25.0, 5.0, 600.0), _level(2, 30.0, 4.0, 300.0, "poisson")]
    against_c1(levels)
    assert "vs_c1" not in levels[0] and "vs_c1" not in levels[2]
    assert levels[1]["vs_c1"] == pytest.approx({"ttft_p50": 1.25, "itl_p50": 1.25, "tokens_per_s": 3.0})


def test_without_a_c1_level_nothing_is_compared() -> None:
    levels = [_level(2, 20.0, 4.0, 200.0), _level(4, 25.0, 5.0, 600.0)]
    against_c1(levels)
    assert all("vs_c1" not in lv for lv in levels)
