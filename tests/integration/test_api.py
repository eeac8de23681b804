"""The local API with the official openai client and plain HTTP, on a real demo model (ONNX Runtime)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from edge_agent.backends import SessionOptions
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.models.tokenizer import Message
from edge_agent.serving.doors.http.server import ApiServer
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    ref = resolve_model("demo-phi3", cache)
    tiers = [
        Tier(
            "small",
            lambda: DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1)),
            Limits(max_batch=2, batch_timeout_ms=0, max_queue=2),
            64,
        )
    ]
    metrics = PrometheusMetrics()
    llm = TieredLLM(tiers, observe=metrics.observe).start()
    metrics.track_load("llm", lambda: llm.load)
    api = ApiServer(llm, metrics, token=TOKEN).start("127.0.0.1", 0)
    reference = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1))
    yield api, llm, reference
    api.stop()
    llm.stop()
    reference.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0].address + "/v1", api_key=TOKEN, max_retries=0)


def greedy_text(reference: DecoderLM, messages: list[Message] | None, prompt: str | None, n: int) -> str:
    tok = reference.tokenizer
    ids = tok.encode_chat(messages) if messages else tok.encode(prompt)
    return tok.decode(list(reference.generate_greedy(ids, n)))


def test_chat_completion_matches_the_models_greedy_output(server, client):
    _, _, reference = server
    out = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0
    )
    want = greedy_text(reference, [Message("user", "Hello there")], None, 6)
    assert out.choices[0].message.content == want
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 0
    assert out.choices[0].finish_reason in ("stop", "length")
    # the tier that answered, an id GET /v1/models lists; the model folder is in the timings
    assert out.model == "small" and "small" in {m.id for m in client.models.list()}
    assert out.model_extra["timings"]["model"] == "demo-phi3"


def test_streamed_chat_adds_up_to_the_same_text(server, client):
    full = client.chat.completions.create(
        messages=[{"role": "user", "content": "Count with me"}], model="edge-agent", max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Count with me"}],
            model="edge-agent",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_use_the_raw_prompt(server, client):
    _, _, reference = server
    out = client.completions.create(model="small", prompt="The kitchen light", max_tokens=5, temperature=0)
    assert out.choices[0].text == greedy_text(reference, None, "The kitchen light", 5)


def test_models_lists_the_tiers(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["edge-agent", "small"]


def _post(server, path: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        server[0].address + path,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


@pytest.mark.parametrize(
    "body, status, fragment, code",
    [
        (b"{not json", 400, "not valid JSON", None),
        (b"[1, 2]", 400, "JSON object", None),
        (b'{"messages": []}', 400, "messages", None),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "role", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 9}', 400, "n", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400, "temperature", None),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}',
            404,
            "not served here",
            "model_not_found",
        ),
        (
            b'{"messages": [{"role": "user", "content": "' + b"word " * 5000 + b'"}], "max_tokens": 8}',
            400,
            "context",
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_openai_shaped_errors(server, body, status, fragment, code):
    got, payload, _ = _post(server, "/v1/chat/completions", body)
    assert got == status
    err = payload["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error" and err["code"] == code


def test_without_the_token_401_and_health_stays_open(server):
    got, payload, _ = _post(server, "/v1/chat/completions", b"{}", token=None)
    assert got == 401 and payload["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(server[0].address + "/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and health["llm"]["model"] == "demo-phi3"


def test_shedding_is_503_with_retry_after(server):
    _, llm, _ = server
    llm.shedding = True
    try:
        got, payload, headers = _post(
            server, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'
        )
    finally:
        llm.shedding = False
    assert got == 503 and headers["Retry-After"] == "5" and "shedding" in payload["error"]["message"]


def test_metrics_are_prometheus_text_with_vllm_like_names(server, client):
    client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model="small", max_tokens=3)
    req = urllib.request.Request(server[0].address + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/plain")
    assert "edge_agent:time_to_first_token_seconds_bucket" in text
    assert 'edge_agent:e2e_request_latency_seconds_count{tier="small",workload="llm"}' in text
    assert 'edge_agent:num_requests_waiting{workload="llm"} 0.0' in text


@pytest.mark.parametrize(
    "exc, status, retry",
    [
        ("Overloaded", 429, "1"),
        ("Unavailable", 503, "5"),
        ("DeadlineExceeded", 503, "2"),
        ("InputError", 400, None),
        ("BackendError", 500, None),
    ],
)
def test_errors_map_to_http_statuses(exc, status, retry):
    import edge_agent.errors as errors
    from edge_agent.serving.doors.http.errors import from_exception as _from_exception

    resp = _from_exception(getattr(errors, exc)("boom"))
    assert resp.status == status and resp.headers.get("Retry-After") == retry
    assert json.loads(resp.body)["error"]["message"] == "boom"


# -- hardening: sizes, timeouts, disconnects, auth -------------------------------------------------


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server, monkeypatch):
    from edge_agent.models.tokenizer import Tokenizer
    from edge_agent.serving.llm.tiers import MAX_CHARS_PER_TOKEN, ContextLengthExceeded

    _, llm, reference = server
    context = reference.contract.max_context

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(Tokenizer, "encode", never)
    monkeypatch.setattr(Tokenizer, "encode_chat", never)
    with pytest.raises(ContextLengthExceeded, match="characters"):
        llm.submit("x" * (context * MAX_CHARS_PER_TOKEN + 1), raw=True)
    with pytest.raises(ContextLengthExceeded, match="messages"):
        llm.submit([Message("user", "")] * (context + 1))
    body = json.dumps({"prompt": "x" * (context * MAX_CHARS_PER_TOKEN + 1), "max_tokens": 2}).encode()
    got, payload, _ = _post(server, "/v1/completions", body)
    assert got == 400 and payload["error"]["code"] == "context_length_exceeded"


@pytest.fixture
def bare(server):
    """A second server on the same model, with short timeouts and no token."""
    api = ApiServer(server[1], header_timeout_s=0.5, body_timeout_s=1.0).start("127.0.0.1", 0)
    yield api
    api.stop()


def _raw(address: str, data: bytes, timeout_s: float = 5) -> bytes:
    import socket

    host, port = address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_body_that_does_not_arrive_in_time_is_408(bare):
    import socket
    import time

    host, port = bare.address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as s:
        t0 = time.monotonic()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages"'
        )
        out = s.recv(65536)
        # The answer comes at the body deadline (1 s here), not when the client gives up (15 s); the close
        # after it is aiohttp's lingering close, which this test does not time.
        answered_s = time.monotonic() - t0
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in out, out[:300]
    assert answered_s < 10, answered_s


def test_idle_keepalive_connections_outlive_the_header_timeout(bare):
    import http.client
    import time

    host, port = bare.address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
            time.sleep(1.0)  # twice the header timeout, idle: no bytes means no request head is late
    finally:
        conn.close()


def test_a_client_that_leaves_mid_response_is_one_log_line_not_a_traceback(server, caplog):
    import asyncio
    import logging
    import socket

    from aiohttp import web

    class Probe(ApiServer):
        def app(self) -> web.Application:
            app = super().app()

            async def leave(request: web.Request) -> web.StreamResponse:
                resp = web.StreamResponse()
                await resp.prepare(request)
                await resp.write(b"x")
                for _ in range(250):
                    if request.transport is None or request.transport.is_closing():
                        break
                    await asyncio.sleep(0.02)
                raise ConnectionResetError("Cannot write to closing transport")  # as aiohttp's writer does

            app.router.add_get("/probe/leave", leave)
            return app

    api = Probe(server[1]).start("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.INFO):
            host, port = api.address.removeprefix("http://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"GET /probe/leave HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 200")
            import time

            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any("went away" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
    finally:
        api.stop()
    assert any("client went away during GET /probe/leave" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records
    ]


def test_the_token_is_compared_in_constant_time_and_odd_headers_are_401(server, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    for header in ("Bearer wrong", "Bearer s3cr\u00e9t", f"Bearer {TOKEN}x"):
        req = urllib.request.Request(server[0].address + "/v1/models", headers={"Authorization": header})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401 and json.loads(err.value.read())["error"]["code"] == "invalid_api_key"
    assert len(calls) == 3 and all(isinstance(a, bytes) for a, _ in calls)
    req = urllib.request.Request(server[0].address + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_an_empty_token_is_refused_rather_than_disabling_auth(server):
    from edge_agent.errors import EdgeAgentError

    with pytest.raises(EdgeAgentError, match="empty"):
        ApiServer(server[1], token="")
    with pytest.raises(EdgeAgentError, match="empty"):
        ApiServer(server[1], token="  ")


def test_an_open_api_without_a_token_is_warned_about():
    from edge_agent.serving.doors.http.guard import exposure_warning

    warning = exposure_warning("0.0.0.0", 8080, None, None)
    assert warning is not None and "0.0.0.0:8080" in warning and "NO token" in warning
    assert exposure_warning("192.168.1.20", 8080, None, None) is not None
    assert exposure_warning("0.0.0.0", 8080, "s3cret", None) is None
    assert exposure_warning("127.0.0.1", 8080, None, None) is None
    assert exposure_warning("::1", 8080, None, None) is None
    assert exposure_warning("0.0.0.0", 8080, None, "/run/edge-agent/api.sock") is None


def test_a_unix_socket_in_use_is_refused_a_stale_one_removed(tmp_path):
    import socket

    from edge_agent.errors import EdgeAgentError
    from edge_agent.serving.doors.http.guard import claim_unix_socket

    path = tmp_path / "api.sock"
    claim_unix_socket(str(path))  # nothing there: fine
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        with pytest.raises(EdgeAgentError, match="already serving") as err:
            claim_unix_socket(str(path))
        assert str(path) in str(err.value)
    finally:
        live.close()
    assert path.exists()  # closed without unlinking: stale
    claim_unix_socket(str(path))
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(EdgeAgentError, match="not a socket"):
        claim_unix_socket(str(path))


def test_clients_that_leave_while_their_body_arrives_cost_one_line_not_a_traceback(server, caplog, monkeypatch):
    import logging
    import socket
    import struct
    import threading

    from edge_agent.logsetup import LogLimiter
    from edge_agent.serving.doors.http import guard as http_guard

    clients = 30
    if hasattr(http_guard, "DEPARTURES"):  # one period for the whole test: the limiter's clock stands still
        monkeypatch.setattr(http_guard, "DEPARTURES", LogLimiter(clock=lambda: 0.0, logger=http_guard.DEPARTURES.log))
    reading, answered = threading.Semaphore(0), threading.Semaphore(0)

    class Probe(ApiServer):
        async def _generate(self, request, chat):
            reading.release()  # its head is in; its body is still arriving
            try:
                return await super()._generate(request, chat)
            finally:
                answered.release()

    api = Probe(server[1], token=TOKEN).start("127.0.0.1", 0)
    host, port = api.address.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    ).encode()
    socks = []
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(clients):
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(head + b'{"messages": [{"role": "user", "content": "' + b"x" * 1000)
                socks.append(s)
            for _ in range(clients):
                assert reading.acquire(timeout=30), "a request never reached its handler"
            for i, s in enumerate(socks):
                if i % 2:  # half reset the connection, half close it
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            for _ in range(clients):
                assert answered.acquire(timeout=30), "a handler never finished"
    finally:
        for s in socks:
            s.close()
        api.stop()
    noisy = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert not noisy, f"{len(noisy)} lines like: {noisy[:1]}"
    left = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert left == ["client went away during POST /v1/chat/completions"]


def _post_chat(server, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        server[0].address + "/v1/chat/completions",
        json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), {"raw": resp.read().decode()}
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_a_chat_predicted_over_its_budget_gets_429_with_retry_after_before_any_stream(server):
    _, llm, _ = server
    messages = [{"role": "user", "content": "hi"}]
    status, _, _ = _post_chat(server, {"messages": messages, "max_tokens": 3})  # the rates are measured
    assert status == 200
    lm, gate = llm._active.lm, threading.Event()
    step = lm.decode_runs

    def gated(*args, **kwargs):  # the chats ahead hold their rows until the test is done
        gate.wait(60)
        return step(*args, **kwargs)

    lm.decode_runs = gated
    ahead = [llm.submit([Message("user", "hi")], SamplingParams(max_new_tokens=8))]
    try:
        next(iter(ahead[0]))  # in a row: its first token out, its next step held (the device is busy)
        llm.sla_ms = lambda: 0.001
        status, headers, body = _post_chat(server, {"messages": messages, "max_tokens": 3, "stream": True})
    finally:
        llm.sla_ms = None
        gate.set()
        lm.decode_runs = step
    assert [len(h.result(30).token_ids) for h in ahead] == [8]
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "overloaded" and "budget" in body["error"]["message"]
    assert body["error"]["reason"] == "over_budget"  # refused at arrival, not after waiting
    # the client's own budget: checked like any field, and it only ever shortens the SLA's
    for bad in (0, -5, 10**9, "soon"):
        status, _, body = _post_chat(server, {"messages": messages, "deadline_ms": bad})
        assert status == 400 and "deadline_ms" in body["error"]["message"], (bad, body)
    llm.sla_ms = lambda: 60_000.0
    try:
        status, _, _ = _post_chat(server, {"messages": messages, "max_tokens": 3, "deadline_ms": 60_000})
        assert status == 200
        # a budget no first token can meet, with nothing ahead: served (refusing it would protect no one)
        status, _, body = _post_chat(server, {"messages": messages, "max_tokens": 3, "deadline_ms": 0.001})
        assert status == 200
    finally:
        llm.sla_ms = None
