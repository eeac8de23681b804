"""`edge-agent bench serve` against a real `edge-agent run` (demo-phi3 on ONNX Runtime CPU): the counts it
reports match what the daemon's own /metrics counted, read here with a parser of the test's own, and what
the client saw is never faster than what the daemon measured for the same requests."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.daemon_proc import Daemon, free_port

_SUCCESS = re.compile(r'^edge_agent:request_success_total\{[^}]*workload="llm"[^}]*\}\s+(\S+)$', re.M)


def _successes(daemon: Daemon) -> float:
    text = urllib.request.urlopen(daemon.url("/metrics"), timeout=10).read().decode()
    return sum(float(v) for v in _SUCCESS.findall(text))


def test_bench_serve_counts_match_the_daemon_and_client_ttft_is_not_below_it(tmp_path):
    daemon = Daemon(tmp_path / "agent", broker_port=free_port(), listen=False)
    try:
        daemon.start()
        before = _successes(daemon)
        exe = Path(sys.executable).with_name("edge-agent")
        cmd = [str(exe), "bench", "serve", "--url", daemon.url(), "--requests", "6", "--concurrency", "1,2"]
        done = subprocess.run([*cmd, "--json", "--quiet"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        after = _successes(daemon)
    finally:
        out = daemon.close()
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2], out
    c1, c2 = report["levels"]
    assert c1["ramp_s"] == 0.0 and c2["ramp_s"] > 0.0  # C=2's clients start the warm-up's e2e / 2 apart
    assert "vs_c1" not in c1
    assert c2["vs_c1"]["ttft_p50"] == pytest.approx(c2["client"]["ttft_ms"]["p50"] / c1["client"]["ttft_ms"]["p50"])
    # Every request the bench sent, the warm-up included, is one the daemon counted; no more.
    sent = sum(lv["client"]["requests"] for lv in report["levels"]) + report["warmup"]
    assert after - before == sent == 12 + report["warmup"]
    for lv in report["levels"]:
        client, served = lv["client"], lv["daemon"]
        assert client["ok"] == client["requests"] == 6, client["errors"]
        assert served["requests"] == 6 and served["ttft_ms"]["count"] == 6, served
        # Each client TTFT spans its daemon TTFT (HTTP, parsing and tokenizing come on top), so at every
        # bucket bound at least as many daemon TTFTs as client TTFTs lie below it, the exact means
        # (_sum / _count) keep that order, and the client's median is not below the bucket of the daemon's.
        # A response whose tokens all decode to nothing (random weights can emit ids without text) has no
        # client TTFT: the bench counts it as no_content; the daemon still timed its first token.
        ttfts = client["ttft_values_ms"]
        assert len(ttfts) == 6 - client["no_content"] > 0
        for le_ms, count in served["ttft_ms"]["buckets_ms"]:
            below = sum(1 for t in ttfts if le_ms is None or t <= le_ms)
            assert count >= below, (le_ms, count, ttfts)
        if client["no_content"] == 0:  # the same requests on both sides: their means and medians compare
            assert client["ttft_ms"]["mean"] >= served["ttft_ms"]["mean"]
            assert client["ttft_ms"]["p50"] >= served["ttft_ms"]["p50_bucket"][0]
            assert lv["client_over_daemon"]["ttft_ms"]["mean"] >= 1.0
        # The usage chunks' token counts add up to the daemon's generated tokens.
        assert client["tokens_out"] == served["tokens_out"] > 0
