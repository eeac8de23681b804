"""`edge-agent run` with an engine recipe and an empty cache, as a subprocess with a test-owned NOTIFY_SOCKET
and a real mosquitto: READY comes at once on the model folder (EXTEND_TIMEOUT_USEC only before it), the
build reports on STATUS= and evt/engine_build, the tier swaps onto the engine (evt/engine_swap) while the
API keeps answering; a restart finds the engine in the cache and builds nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon_proc import Listener, Notify, config_text, start_agent, stop
from tests.e2e.test_daemon import validate
from tests.mqtt_broker import Broker, free_port, wait_for

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]

RECIPE = f"""
name = "tiny-phi3"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32"]
[heldout]
data = "{ROOT}/calibration/llm/heldout.jsonl"
samples = 4
[accuracy]
min_cosine = 0.9
min_top1 = 0.5
max_kl = 0.5
"""


def ready_index(notify: Notify, nth: int = 1) -> int:
    return [i for i, m in enumerate(notify.messages) if m.get("READY") == "1"][nth - 1]


@pytest.mark.slow
def test_daemon_serves_at_once_builds_in_the_background_and_swaps(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    api_port = free_port()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny-phi3.toml").write_text(RECIPE)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        config_text(tmp_path, broker.port, api_port)
        + f'\n[engines]\ncache_dir = "{tmp_path / "engines"}"\nrecipes_dir = "{tmp_path / "recipes"}"\n'
    )
    notify = Notify(tmp_path / "notify.sock")
    listener = Listener(broker.port)
    proc = start_agent(cfg, notify)
    try:
        wait_for(lambda: notify.seen("READY", "1") or proc.poll() is not None, 120, what="READY=1")
        assert proc.poll() is None, stop(proc)
        wait_for(lambda: listener.of("evt/engine_swap") or proc.poll() is not None, 120, what="evt/engine_swap")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="small", prompt="Hi", max_tokens=3)
        assert out.usage.completion_tokens >= 1

        builds = listener.of("evt/engine_build")
        assert [e["data"]["state"] for e in builds] == ["started", "finished"]
        for event in builds + listener.of("evt/engine_swap"):
            validate("event", event)
        key = builds[-1]["data"]["engines"]["small"]
        assert listener.of("evt/engine_swap")[0]["data"]["serving"] == f"engine:{key}"
        assert (tmp_path / "engines" / "entries" / key / "model" / "model.onnx").is_file()
        # systemd: EXTEND_TIMEOUT_USEC only while the start waited; the build's progress on STATUS=.
        first_ready = ready_index(notify)
        extends = [i for i, m in enumerate(notify.messages) if "EXTEND_TIMEOUT_USEC" in m]
        assert extends and max(extends) < first_ready
        assert any("building engine tiny-phi3" in m.get("STATUS", "") for m in notify.messages[first_ready:])

        # Restart: the cached engine is served from the start; nothing is built.
        proc.terminate()
        assert proc.wait(60) == 0
        before = len(listener.of("evt/engine_build"))
        proc = start_agent(cfg, notify)
        wait_for(
            lambda: sum(1 for m in notify.messages if m.get("READY") == "1") >= 2 or proc.poll() is not None,
            120,
            what="second READY",
        )
        assert proc.poll() is None, stop(proc)
        assert client.completions.create(model="small", prompt="Again", max_tokens=3).usage.completion_tokens >= 1
        proc.terminate()
        assert proc.wait(60) == 0
        assert len(listener.of("evt/engine_build")) == before
        out_text = proc.stdout.read() if proc.stdout else ""
        assert f"serves engine {key[:12]}" in out_text, out_text[-2000:]
    finally:
        stop(proc)
        listener.close()
        notify.close()
        broker.stop()
