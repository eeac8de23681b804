"""Admission across the NPU and the CPU: a one-sequence tier (the NPU's LLM mode, emulated on the CPU)
is served with the next tier loaded beside it, and what it cannot take in time goes there at once.

Ordering is explicit: the NPU tier's decode steps are held on an event while a request runs there, so
"the NPU is busy" is a fact of the test, not of timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.metrics.window import WARMUP
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM

pytest.importorskip("openvino")

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


class HeldDecode:
    """Wraps a DecoderLM's ``decode``: while ``hold`` is set, each step waits for ``release``."""

    def __init__(self, lm: DecoderLM) -> None:
        self.hold, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()
        inner = lm.decode

        def decode(batch, tokens):
            if self.hold.is_set():
                self.entered.set()
                assert self.release.wait(60), "the test never released the held decode"
            return inner(batch, tokens)

        lm.decode = decode  # type: ignore[method-assign]


@pytest.fixture
def ladder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    ref = resolve_model("demo-phi3", tmp_path / "models")
    held: list[HeldDecode] = []
    opens = {"cpu": 0}

    def open_cpu() -> DecoderLM:
        opens["cpu"] += 1
        return DecoderLM.open(ref, "onnxruntime")

    def open_npu() -> DecoderLM:
        lm = DecoderLM.open(ref, "openvino", SessionOptions(device="NPU", extra={"npu_llm": npu.LlmShape(64, 64)}))
        held.append(HeldDecode(lm))
        return lm

    tiers = [
        Tier("npu", open_npu, Limits(max_batch=4, batch_timeout_ms=0), 64, "demo-phi3"),
        Tier("cpu", open_cpu, Limits(max_batch=4, batch_timeout_ms=0), 64, "demo-phi3"),
    ]
    served = TieredLLM(tiers, spill_slack_ms=1e9).start()
    reference = DecoderLM.open(ref, "onnxruntime")
    yield served, held[0], reference, opens
    held[0].release.set()
    served.stop(5)
    reference.close()


def _prompt(seed: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


def _want(reference: DecoderLM, ids: list[int], n: int = 8) -> list[int]:
    return list(reference.generate_greedy(ids, n, stop_at_eos=False))


def test_a_busy_npu_spills_the_next_request_to_the_cpu_tier_at_once(ladder) -> None:
    served, held, reference, _opens = ladder
    tok = reference.tokenizer
    a_text, b_text, c_text = "turn on the lights", "what is the time", "play some music"
    a = served.submit(a_text, GREEDY, raw=True)
    assert a.tier == "npu" and a.spill is None
    a_done = a.result()  # the NPU tier now has recent rates to estimate a queue with
    # A threshold no queue meets: an idle NPU still keeps the next request (an idle tier takes every
    # request it can hold); a busy one does not.
    served.spill_slack_ms = 1e-3

    held.hold.set()
    b = served.submit(b_text, GREEDY, raw=True)
    assert held.entered.wait(30)  # b is decoding on the NPU, held there
    c = served.submit(c_text, GREEDY, raw=True)
    assert c.tier == "cpu" and c.spill is not None
    assert c.spill["from"] == "npu" and c.spill["reason"].startswith("queue: expected first token")
    c_done = c.result()  # served while the NPU is still busy with b
    with pytest.raises(TimeoutError):  # b is still held on the NPU
        b.result(timeout_s=0)
    held.hold.clear()
    held.release.set()
    b_done = b.result()
    assert b.tier == "npu" and b.spill is None
    for done, text in ((a_done, a_text), (b_done, b_text), (c_done, c_text)):
        assert list(done.token_ids) == _want(reference, tok.encode(text))


def test_a_request_beyond_the_npus_context_goes_to_the_cpu_tier_with_the_reason(ladder) -> None:
    served, _held, reference, _opens = ladder
    long_text = " ".join(["lights"] * 120)  # more tokens than the NPU's 127-token KV state with 8 new
    handle = served.submit(long_text, GREEDY, raw=True)
    assert handle.tier == "cpu" and handle.spill is not None and handle.spill["from"] == "npu"
    assert "cannot take it" in handle.spill["reason"] and "127" in handle.spill["reason"]
    ids = reference.tokenizer.encode(long_text)
    assert list(handle.result().token_ids) == _want(reference, ids)


def test_a_switch_down_takes_the_spill_tier_over_and_a_switch_up_keeps_it(ladder) -> None:
    served, _held, _reference, opens = ladder
    assert served.spill_tier == "cpu" and opens["cpu"] == 1
    assert served.switch_to(1)
    served.wait_switched()
    assert served.active_tier == "cpu" and served.spill_tier is None and opens["cpu"] == 1  # taken over
    assert served.switch_to(0)
    served.wait_switched()
    assert served.active_tier == "npu" and served.spill_tier == "cpu" and opens["cpu"] == 1  # kept
    handle = served.submit("hello there", GREEDY, raw=True)
    assert handle.result().finish_reason == "length"


def test_a_warm_up_goes_where_the_request_it_warms_will_go(ladder) -> None:
    # A voice turn's prefill ahead asks one token, which the NPU could hold; the reply it warms asks 48, with
    # a prompt the NPU's 127-token cache cannot hold with them: the warm-up fills the CPU tier's cache.
    served, _held, _reference, _opens = ladder
    text = " ".join(["lights"] * 90)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    warm = served.submit(text, one, raw=True, tags=(WARMUP,), route_new_tokens=48)
    warm.result()
    reply = served.submit(text, SamplingParams(max_new_tokens=48, temperature=0.0), raw=True)
    reply.result()
    assert (warm.tier, reply.tier) == ("cpu", "cpu")
    assert warm.spill is not None and "cannot take it" in warm.spill["reason"]
    assert reply.result().timing.cached_tokens > 0  # the warm-up's prefix served the reply
    small = served.submit("lights on", one, raw=True, tags=(WARMUP,), route_new_tokens=8)
    assert small.tier == "npu"  # a reply that fits the NPU: its warm-up goes there too
    small.result()
