"""The comparison table of scripts/bench-peers: figures, medians and spreads, ratios, and the rendered cells."""

from __future__ import annotations

import statistics

import pytest

from edge_agent.bench import peers


def test_single_and_concurrent_figures_follow_their_definitions():
    ttft = [200.0, 250.0, 300.0]
    itl = [4.0, 5.0, 5.0, 6.0, 10.0]
    got = peers.single_figures(ttft, itl, prompt_tokens=256)
    assert got["decode_tps"] == pytest.approx(1000.0 / statistics.median(itl))
    assert got["prefill_tps"] == pytest.approx(256 / 0.25)
    conc = peers.concurrent_figures([90.0, 110.0, 100.0, 300.0], tokens=512, wall_s=4.0)
    assert conc == {"c4_ttft_ms": pytest.approx(105.0), "c4_tps": pytest.approx(128.0)}


@pytest.mark.parametrize("bad", [([], [1.0]), ([1.0], [])])
def test_single_figures_refuse_an_empty_run(bad):
    with pytest.raises(ValueError, match="single_figures"):
        peers.single_figures(*bad, prompt_tokens=8)


def test_summary_has_median_spread_and_agent_over_peer_ratios():
    rounds = {
        "m": {
            peers.AGENT: {"decode_tps": [100.0, 90.0, 110.0], "c4_ttft_ms": [50.0, 70.0, 60.0]},
            "peer": {"decode_tps": [200.0, 180.0, 220.0], "c4_ttft_ms": [30.0, 20.0, 40.0]},
            "absent": {"decode_tps": []},
        }
    }
    s = peers.summarize(rounds)["m"]
    assert s[peers.AGENT]["decode_tps"] == {"median": 100.0, "min": 90.0, "max": 110.0, "n": 3}
    assert s["peer"]["ratio"]["decode_tps"] == pytest.approx(0.5)
    assert s["peer"]["ratio"]["c4_ttft_ms"] == pytest.approx(2.0)
    assert s["peer"]["ratio"]["prefill_tps"] is None
    assert "decode_tps" not in s["absent"] and s["absent"]["ratio"]["decode_tps"] is None
    assert "ratio" not in s[peers.AGENT]


def test_table_rows_cells_and_reasons():
    rounds = {"m": {peers.AGENT: {"decode_tps": [100.0, 90.0, 110.0]}, "peer": {"decode_tps": [200.0, 180.0, 220.0]}}}
    table = peers.format_table(
        peers.summarize(rounds),
        [peers.AGENT, "peer", "gone"],
        reasons={("m", "gone"): {"*": "not built: no compiler"}, ("m", "peer"): {"c4_tps": "n/a: one sequence"}},
    )
    lines = table.splitlines()
    assert len(lines) == 5 and lines[0].startswith("| model | engine | decode tok/s (batch 1)")
    agent, peer, gone = (line.split(" | ") for line in lines[2:])
    assert agent[2] == "100.0 [90.0–110.0]" and agent[3] == "—"
    assert peer[2] == "200.0 [180.0–220.0] ×0.50" and peer[5].startswith("n/a: one sequence")
    assert all(c.strip(" |") == "not built: no compiler" for c in gone[2:])
