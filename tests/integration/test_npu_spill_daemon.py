"""The spill decision on the agent itself: an NPU tier (emulated on the CPU) above a CPU tier of the same
model, the real ``Agent`` in-process from a config file, its controller, reload and fleet SLA.

Time is a fake clock that only the NPU moves: each prompt it prefills costs ``prefill_ms`` and each token
it generates ``decode_ms``, so the NPU's first-token and request times are facts of the test, not of the
machine. "The NPU is busy" is held on an event (its decode steps wait while ``hold`` is set), and
requests "arriving together" meet in the NPU tokenizer before any of them goes on.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from edge_agent.config import load_settings
from edge_agent.daemon import app
from edge_agent.daemon.app import Agent
from edge_agent.models.sampling import SamplingParams
from edge_agent.models.tokenizer import Message
from edge_agent.serving.llm.tiers import TieredLLM
from edge_agent.systemd import Notifier
from edge_agent.telemetry.schema import SlaSpec
from tests.mqtt_broker import free_port

pytest.importorskip("openvino")

CONFIG = """
[models]
asr = []
[[models.llm]]
name = "npu"
model = "demo-phi3"
backend = "openvino"
device = "NPU"
max_new_tokens = 64
[[models.llm]]
name = "cpu"
model = "demo-phi3"
max_new_tokens = 64

[device]
npu_emulation = "cpu"
threads = 1

[engines]
build_on_start = false
cache_dir = "{tmp}/engines"

[batching]
batch_timeout_ms = 0

[mqtt]
host = "127.0.0.1"
port = {mqtt}
device_id = "dev-spill"

[telemetry]
spool_path = "{tmp}/spool.sqlite"
ledger_path = "{tmp}/ledger.sqlite"

[api]
host = "127.0.0.1"
port = 0

[sla]
{sla}
"""
PROMPT = [Message("user", "turn on the kitchen lights please")]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SlowNpu:
    """The NPU tier's model, slowed on the fake clock and held on events (see the module doc)."""

    def __init__(self, lm, clock: FakeClock, prefill_ms: float, decode_ms: float) -> None:
        self.clock, self.prefill_ms, self.decode_ms = clock, prefill_ms, decode_ms
        self.hold, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()
        self.gate: tuple[int, threading.Event, list[int]] | None = None  # tokenizations that wait for each other
        join, chunk, decode, tok = lm.join, lm.prefill_chunk, lm.decode, lm.tokenizer
        encode_chat = tok.encode_chat

        def slow_join(*a, **k):
            out = join(*a, **k)
            self.clock.now += self.prefill_ms / 1e3
            return out

        def slow_chunk(*a, **k):
            out = chunk(*a, **k)
            if out is not None:
                self.clock.now += self.prefill_ms / 1e3
            return out

        def held_decode(*a, **k):
            if self.hold.is_set():
                self.entered.set()
                assert self.release.wait(60), "the test never released the held decode"
            self.clock.now += self.decode_ms / 1e3
            return decode(*a, **k)

        def gated_encode_chat(*a, **k):
            ids = encode_chat(*a, **k)
            if self.gate is not None:
                parties, met, count = self.gate
                count.append(1)
                if len(count) == parties:
                    met.set()
                if len(count) <= parties:
                    assert met.wait(60), "the requests never met in the tokenizer"
            return ids

        lm.join, lm.prefill_chunk, lm.decode = slow_join, slow_chunk, held_decode
        tok.encode_chat = gated_encode_chat

    def meet(self, parties: int) -> None:
        """The next ``parties`` NPU tokenizations wait until all of them have tokenized."""
        self.gate = (parties, threading.Event(), [])


@pytest.fixture
def npu_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()

    class ClockedLadder(TieredLLM):  # the daemon's ladder (TieredLLM.from_config) on the test's clock
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, clock=clock, **kwargs)

    monkeypatch.setattr(app, "TieredLLM", ClockedLadder)
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    started: list[tuple[Agent, SlowNpu]] = []
    mqtt = free_port()

    def start(sla: str = "target_ms = 387", prefill_ms: float = 60.0, decode_ms: float = 10.0):
        path = tmp_path / "agent.toml"
        path.write_text(CONFIG.format(tmp=tmp_path, mqtt=mqtt, sla=sla))
        agent = Agent(load_settings(str(path)), str(path), notifier=Notifier({}), drain_s=5).start()
        assert agent.llm is not None and agent.llm.active_tier == "npu" and agent.llm.spill_tier == "cpu"
        npu = SlowNpu(agent.llm._active.lm, clock, prefill_ms, decode_ms)
        started.append((agent, npu))
        return agent, npu, path

    yield start
    for agent, npu in started:
        npu.hold.clear()
        npu.release.set()
        agent.stop()


def _chat(agent: Agent, max_new_tokens: int = 8):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return agent.llm.submit(PROMPT, params)


def _busy(agent: Agent, npu: SlowNpu, max_new_tokens: int = 48):
    """A request decoding on the NPU, held there after its first token."""
    npu.hold.set()
    running = _chat(agent, max_new_tokens)
    assert npu.entered.wait(60) and running.tier == "npu"
    return running


def _unhold(npu: SlowNpu, *handles) -> None:
    npu.hold.clear()
    npu.release.set()
    for handle in handles:
        handle.result(60)


def test_one_slow_request_does_not_retire_an_idle_npu(npu_agent) -> None:
    # The first request's first token takes 921 ms on the NPU, over the 387 ms target; every later one is
    # sent with the NPU idle, and the NPU serves each of them.
    agent, npu, _path = npu_agent(prefill_ms=921.0)
    first = _chat(agent)
    first.result(60)
    assert first.tier == "npu" and first.result().timing.ttft_ms == pytest.approx(921.0)
    npu.prefill_ms = 60.0
    served = []
    for _ in range(5):
        handle = _chat(agent)
        handle.result(60)
        served.append((handle.tier, handle.spill))
    assert served == [("npu", None)] * 5
    # and the NPU tier's controller has their samples (the first after load is excluded)
    assert agent.controller.window.count("ttft_ms") == 5


def test_a_spilled_request_counts_in_the_active_tiers_sla_window(npu_agent) -> None:
    agent, npu, _path = npu_agent()
    _chat(agent).result(60)  # the first after load: out of the window
    running = _busy(agent, npu)
    spilled = [_chat(agent) for _ in range(2)]
    for handle in spilled:
        handle.result(60)
        assert handle.tier == "cpu" and handle.spill["from"] == "npu"
    # the CPU's answers to NPU requests, but the first after the CPU tier's load
    assert agent.controller.window.count("ttft_ms") == 1
    _unhold(npu, running)


def test_requests_arriving_together_commit_only_one_to_the_one_sequence_npu(npu_agent) -> None:
    agent, npu, _path = npu_agent()
    _chat(agent).result(60)  # the NPU's rates: 60 ms a prompt, 10 ms a token
    npu.meet(4)  # all four are past the tokenizer before any is handed over
    out: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _chat(agent, 48)), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for handle in out:
        handle.result(60)
    tiers = sorted(h.tier for h in out)
    assert tiers == ["cpu", "cpu", "cpu", "npu"]
    for handle in out:
        if handle.tier == "cpu":
            assert handle.spill["reason"].startswith("queue: expected first token in")
        else:
            assert handle.result().timing.queue_ms == 0.0  # it waited behind nobody


def test_every_way_of_changing_the_sla_changes_the_spill_at_once(npu_agent) -> None:
    agent, npu, path = npu_agent()
    _chat(agent, 48).result(60)
    running = _busy(agent, npu)  # 47 tokens left at 10 ms, then a 60 ms prefill: 530 ms expected
    before = _chat(agent)
    assert before.tier == "cpu" and before.spill["reason"].endswith("> 387 ms")

    path.write_text(path.read_text().replace("target_ms = 387", "target_ms = 5000"))
    assert "applied sla" in agent.reload()
    queued = _chat(agent)  # 530 ms < 5000 ms: it waits for the NPU
    assert queued.tier == "npu" and queued.spill is None

    agent.remote.set_sla("llm", SlaSpec(target_ms=100))
    fleet = _chat(agent)
    assert fleet.tier == "cpu" and fleet.spill["reason"].endswith("> 100 ms")

    desired = {"version": 1, "sla": {"llm": {"target_ms": 20_000}}}
    assert agent.telemetry.commands.apply_desired(json.dumps(desired).encode())
    wanted = _chat(agent)  # 470 ms left, the queued request (60 + 8 × 10 ms), its own 60 ms: 670 ms < 20 s
    assert wanted.tier == "npu" and wanted.spill is None
    _unhold(npu, running, before, queued, fleet, wanted)


def test_an_itl_sla_does_not_spill_a_first_token_that_meets_the_first_token_threshold(npu_agent) -> None:
    # ITL 50 ms: the NPU's 10 ms tokens meet it; its 220 ms first tokens are not ITL and stay under the
    # first-token threshold derived for this metric (387 ms), so the NPU keeps serving.
    agent, npu, _path = npu_agent(sla='metric = "itl_ms"\ntarget_ms = 50', prefill_ms=220.0)
    alone = []
    for _ in range(3):
        handle = _chat(agent)
        handle.result(60)
        alone.append((handle.tier, handle.spill))
    assert alone == [("npu", None)] * 3
    running = _busy(agent, npu, max_new_tokens=8)  # 7 tokens left at 10 ms, then 220 ms: 290 ms
    queued = _chat(agent)
    assert queued.tier == "npu" and queued.spill is None
    _unhold(npu, running, queued)
