"""A request whose output format (``response_format`` / ``tools``) breaks fails alone: a grammar that
cannot take even its first token is refused with a 400 before it is admitted, one that breaks later
fails only its own row while the rest of the batch carries on, and either costs one short log line.

Through the real HTTP API in process, on the demo model (ONNX Runtime). Events are ordered
explicitly: the engine's first decode step with every plain stream in the batch is held until the
bad request has been submitted (queued or refused), so the bad one always meets a running batch."""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from edge_agent.backends import SessionOptions
from edge_agent.errors import InputError
from edge_agent.models import grammar
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.doors.http.server import ApiServer
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler
from edge_agent.serving.llm.tiers import Tier, TieredLLM

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

ASK = [{"role": "user", "content": "tell me a long story"}]
PLAIN = 3
TOKENS = 400
# llguidance takes it at admission (the grammar validates) but its first token sends the Earley parser
# past its item limit: "Too many items (limit 50000)"
SELF_REQUIRED = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}


@pytest.fixture(scope="module")
def model_ref(tmp_path_factory):
    return resolve_model("demo-phi3", tmp_path_factory.mktemp("models"))


class _Gate:
    """Holds the first decode step that runs ``rows`` rows or more until ``release`` is set."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.reached, self.release = threading.Event(), threading.Event()

    def wrap(self, lm: DecoderLM) -> DecoderLM:
        decode = lm.decode

        def gated(batch, tokens, *args, **kwargs):
            if len(tokens) >= self.rows and not self.reached.is_set():
                self.reached.set()
                assert self.release.wait(60), "the bad request was never submitted"
            return decode(batch, tokens, *args, **kwargs)

        lm.decode = gated  # type: ignore[method-assign]
        return lm


@pytest.fixture
def served(model_ref):
    """(API, gate): one tier of 4 rows whose first full decode step waits for a request with a format."""
    gate = _Gate(PLAIN)
    tier = Tier(
        "small",
        lambda: gate.wrap(DecoderLM.open(model_ref, "onnxruntime", SessionOptions(threads=1))),
        Limits(max_batch=PLAIN + 1, batch_timeout_ms=0),
        TOKENS,
    )
    llm = TieredLLM([tier]).start()
    submit = llm.submit

    def watched(prompt, params, *args, **kwargs):  # the gate opens once the formatted request is queued or refused
        try:
            return submit(prompt, params, *args, **kwargs)
        finally:
            if params.grammar is not None:
                gate.release.set()

    llm.submit = watched  # type: ignore[method-assign]
    api = ApiServer(llm).start("127.0.0.1", 0)
    yield api, gate
    gate.release.set()
    api.stop()
    llm.stop()


def _plain_streams(api) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    client = openai.OpenAI(base_url=api.address + "/v1", api_key="none", max_retries=0, timeout=120)
    results: list[dict[str, Any]] = [{} for _ in range(PLAIN)]

    def stream(out: dict[str, Any]) -> None:
        out.update(text="", chunks=0, reason=None, usage=None, error=None)
        try:
            for chunk in client.chat.completions.create(
                model="small",
                messages=ASK,
                max_tokens=TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                for choice in chunk.choices:
                    if choice.delta.content:
                        out["chunks"] += 1
                        out["text"] += choice.delta.content
                    out["reason"] = choice.finish_reason or out["reason"]
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.completion_tokens
        except Exception as exc:  # an in-band error chunk: what the test is looking for
            out["error"] = str(exc)

    threads = [threading.Thread(target=stream, args=(out,), daemon=True) for out in results]
    for t in threads:
        t.start()
    return threads, results


def _post(api, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        api.address + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _bad(description: str | None = None) -> dict[str, Any]:
    schema = dict(SELF_REQUIRED, description=description) if description is not None else SELF_REQUIRED
    return {
        "model": "small",
        "messages": ASK,
        "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "node", "schema": schema}},
    }


def test_a_schema_that_breaks_on_its_first_token_is_a_400_and_the_batch_carries_on(served):
    api, gate = served
    threads, results = _plain_streams(api)
    assert gate.reached.wait(60), "the plain streams never ran together"
    status, body = _post(api, _bad())
    for t in threads:
        t.join(120)
    for out in results:  # every plain stream ran to its end, and none saw the other request's text
        assert out["error"] is None, (out["chunks"], out["error"][:300])
        assert out["reason"] == "length" and out["usage"] == TOKENS, out
        assert "output format" not in out["text"] and "Too many items" not in out["text"]
    message = body["error"]["message"]
    assert status == 400, body
    assert "response_format" in message and "Too many items" in message, message


def test_a_schema_with_a_huge_description_logs_one_short_line_and_no_traceback(served, caplog):
    api, gate = served
    caplog.set_level(logging.DEBUG)
    for _ in range(2):  # the second within the rate limit's period: held back, counted in the next line
        status, body = _post(api, _bad("x" * 5_000_000))
        assert status == 400, body["error"]["message"][:500]
        assert len(body["error"]["message"]) < 2_000  # the client's answer is not its own schema back either
    assert "Traceback" not in caplog.text
    assert len(caplog.text.encode()) < 2_048, f"{len(caplog.text.encode())} bytes of log"
    lines = [r.getMessage() for r in caplog.records if "output format" in r.getMessage()]
    assert len(lines) == 1 and "Too many items" in lines[0], lines


class _FailsAt:
    """An llguidance matcher that breaks at its ``k``-th consumed token or mask, the way llguidance
    does: nothing raises, the error (with its parser state and the whole grammar) is kept."""

    def __init__(self, matcher: Any, k: int, where: str) -> None:
        self._m, self.k, self.where, self.calls, self.failed = matcher, k, where, 0, False

    def _due(self, where: str) -> bool:
        if where == self.where:
            self.calls += 1
            self.failed = self.failed or self.calls >= self.k
        return self.failed

    def consume_token(self, token: int) -> bool:
        return False if self._due("consume") else self._m.consume_token(token)

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self._m.unsafe_compute_mask_ptr(ptr, size)
        if self._due("mask"):
            ctypes.memset(ptr, 0, size)  # llguidance leaves no token allowed once in error

    def is_error(self) -> bool:
        return self.failed or self._m.is_error()

    def get_error(self) -> str:
        if self.failed:
            return "parser error: simulated failure\n<state>…</state><grammar>" + "g" * 100_000 + "</grammar>"
        return self._m.get_error()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


@pytest.mark.parametrize("where", ["consume", "mask"])
def test_a_format_that_breaks_at_a_later_token_fails_only_its_own_row(model_ref, monkeypatch, caplog, where):
    lm = DecoderLM.open(model_ref, "onnxruntime", SessionOptions(threads=1))
    vocab = lm.token_vocab
    constraint = vocab.constraint

    def breaking(text: str):
        c = constraint(text)  # the real check at submit passes: the grammar breaks later
        c._m = _FailsAt(c._m, k=6, where=where)
        return c

    monkeypatch.setattr(vocab, "constraint", breaking)
    caplog.set_level(logging.DEBUG)
    scheduler = LLMScheduler(lm, Limits(max_batch=4, batch_timeout_ms=0))
    prompt = lm.tokenizer.encode("once upon a time")
    plain = SamplingParams(max_new_tokens=60, ignore_eos=True)
    # all four queued before the loop starts: admitted together, one batch
    handles = [scheduler.submit(prompt, plain) for _ in range(3)]
    bad = scheduler.submit(prompt, SamplingParams(max_new_tokens=60, grammar=grammar.json_object_grammar()))
    scheduler.start()
    try:
        with pytest.raises(InputError) as err:
            bad.result(60)
        assert "output format broke" in str(err.value) and "simulated failure" in str(err.value)
        assert len(str(err.value)) < 1_000
        alone = LLMScheduler(lm, Limits(max_batch=1)).start()
        try:
            reference = alone.submit(prompt, plain).result(60)
        finally:
            alone.stop()
        for h in handles:
            done = h.result(60)
            assert done.finish_reason == "length" and done.token_ids == reference.token_ids
    finally:
        scheduler.stop()
        lm.close()
    assert "Traceback" not in caplog.text and len(caplog.text.encode()) < 2_048
    assert sum("output format broke" in r.getMessage() for r in caplog.records) == 1
