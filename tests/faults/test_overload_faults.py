"""Overload faults (issue 42, "bad input and faults"), from outside, against a real ``edge-agent run``
(the one-tier demo-phi3 e2e config), a real mosquitto and plain HTTP clients:

- a body ``deadline_ms`` of 0, negative, absurd or of the wrong type: 400 naming the field, streamed or not;
- a burst of 500 chats at once: every one answered with a status (200, 429 with ``Retry-After`` or 503
  with ``Retry-After``), no connection reset, nothing left running or waiting, a fresh chat served
  afterwards, no traceback in the log; every refusal counted in ``/metrics`` and, to the same total,
  in the MQTT telemetry windows;
- a client that leaves while its chat waits: its place is freed at once (``/health``'s ``waiting``
  drops while the chat ahead still runs) and the next waiter starts when the row frees;
- a SIGHUP and a fleet ``pin_tier`` during a burst: the same answers, the reload and the pin applied;
- a chat preempted by a voice turn whose client then leaves (at the ladder, on the real demo model:
  the daemon's voice path needs an ASR tier and audio): the voice turn keeps its tokens, the row is
  free afterwards and the next chat's output is the model's reference.

Events are ordered by polling what the daemon reports, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

from tests.daemon_proc import Daemon, config_text, free_port, wait_for
from tests.mqtt_broker import Broker

pytest.importorskip("paho.mqtt.client")
aiohttp = pytest.importorskip("aiohttp")

# Appended to the e2e config: a short SLA window and cooldown, so shedding that a burst causes ends
# soon after it (tests/faults/test_shedding.py); the file's [sla] evaluates every second.
SLA = """window_s = 3.0
min_samples = 2
cooldown_s = 4.0
min_dwell_s = 0
"""
RECOVER_S = 3.0 + 4.0 + 20.0  # window_s + cooldown_s, plus a request's own time and a slow machine's slack
TWO_TIERS = '[[models.llm]]\nname = "light"\nmodel = "demo-phi3"\nmax_new_tokens = 16\nmax_batch = 2\n'
MESSAGES = [{"role": "user", "content": "hi"}]


def post(daemon: Daemon, body: dict, timeout_s: float = 60.0) -> tuple[int, dict, dict | str]:
    """POST /v1/chat/completions; (status, headers, JSON body or the raw text of a stream)."""
    req = urllib.request.Request(
        daemon.url("/v1/chat/completions"), json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read().decode()
            return resp.status, dict(resp.headers), (raw if body.get("stream") else json.loads(raw))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def health(daemon: Daemon) -> dict:
    with urllib.request.urlopen(daemon.url("/health"), timeout=10) as resp:
        return json.loads(resp.read())["llm"]


def metric(daemon: Daemon, name: str) -> float:
    """The sum of every sample of ``name`` on /metrics (all label sets)."""
    with urllib.request.urlopen(daemon.url("/metrics"), timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def served_again(daemon: Daemon, limit_s: float = RECOVER_S) -> dict:
    """A fresh chat, tried until one is served (a burst may leave the tier shedding for cooldown_s + window_s:
    503 with Retry-After until then); its body."""
    start, seen = time.monotonic(), Counter()
    while time.monotonic() - start < limit_s:
        status, headers, body = post(daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 4})
        if status == 200:
            return body
        seen[status] += 1
        assert status in (429, 503) and int(headers["Retry-After"]) >= 1, (status, body)
        wait_for(lambda: health(daemon)["waiting"] == 0, 10, what="an empty queue")  # bounded polling, no sleep
    raise AssertionError(f"no chat served {limit_s:.0f} s after the burst: {dict(seen)}")


def no_traceback(daemon: Daemon) -> None:
    out = daemon.output()
    assert "Traceback" not in out, out[out.index("Traceback") - 2000 :][:5000]


async def _burst(daemon: Daemon, n: int, answered: list[int] | None = None) -> list[tuple]:
    """``n`` chats at once, each on its own connection; (status, Retry-After, error code, answer) each,
    or (exception name, ...) for a request that got no status. ``answered`` grows by one per answer."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:

        async def one(i: int) -> tuple:
            body = {"model": "small", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8}
            if i % 2:
                body["stream"] = True
            try:
                async with session.post(
                    daemon.url("/v1/chat/completions"), json=body, timeout=aiohttp.ClientTimeout(total=120)
                ) as resp:
                    raw = await resp.read()
                    if answered is not None:
                        answered.append(resp.status)
                    if resp.status == 200:
                        text = raw.decode()
                        ok = "[DONE]" in text and '"error"' not in text if body.get("stream") else "choices" in text
                        return resp.status, None, None, ok
                    err = json.loads(raw)["error"]
                    return resp.status, resp.headers.get("Retry-After"), err.get("code"), err["message"]
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                return type(exc).__name__, None, None, str(exc)

        return await asyncio.gather(*(one(i) for i in range(n)))


def burst(daemon: Daemon, n: int, answered: list[int] | None = None) -> list[tuple]:
    return asyncio.run(_burst(daemon, n, answered))


def check_answers(results: list[tuple], n: int) -> Counter:
    """Every request answered with a status; refusals carry Retry-After and a reason; 200s are complete."""
    assert len(results) == n
    by_status = Counter(r[0] for r in results)
    unanswered = [r for r in results if not isinstance(r[0], int)]
    assert not unanswered, f"{len(unanswered)} of {n} got no status, e.g. {unanswered[:3]}"
    assert set(by_status) <= {200, 429, 503}, by_status
    for status, retry_after, code, answer in results:
        if status == 200:
            assert answer is True, "a 200 without its whole answer (or with an error inside the stream)"
        else:
            assert retry_after is not None and int(retry_after) >= 1, (status, code, answer)
            assert code in ("overloaded", "unavailable") and answer and "\n" not in answer, (status, code, answer)
    return by_status


@pytest.fixture
def broker(tmp_path):
    b = Broker(tmp_path / "broker").start()
    yield b
    b.kill()


def start_daemon(
    tmp_path, broker: Broker, extra: str = SLA, config: str | None = None, api_port: int | None = None
) -> Daemon:
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, extra=extra, config=config, api_port=api_port)
    daemon.start()
    wait_for(lambda: daemon.listener.of("reported"), 30, what="the first reported")
    return daemon


@pytest.fixture
def daemon(tmp_path, broker):
    d = start_daemon(tmp_path, broker)
    try:
        yield d
    finally:
        print(d.close()[-3000:])  # shown by pytest only when the test fails


def test_a_deadline_of_zero_negative_absurd_or_not_a_number_is_400_naming_the_field(daemon):
    for stream in (False, True):
        for bad in (0, -1, -0.5, -1e9, 600_001, 10**9, 1e308, "soon", True, [5], {"ms": 5}):
            body = {"model": "small", "messages": MESSAGES, "max_tokens": 3, "deadline_ms": bad, "stream": stream}
            status, _, answer = post(daemon, body)
            assert status == 400, (bad, stream, status, answer)
            message = answer["error"]["message"]
            assert "deadline_ms" in message and "\n" not in message and len(message) < 300, (bad, message)
    # JSON's non-numbers that Python's parser accepts: never a deadline
    for raw in (b"NaN", b"Infinity", b"-Infinity"):
        text = b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "deadline_ms": %s}' % raw
        req = urllib.request.Request(daemon.url("/v1/chat/completions"), text, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400, raw
        assert "deadline_ms" in json.loads(refused.value.read())["error"]["message"], raw
    # the bounds themselves are a deadline: served (600000) or refused at once for its budget (429), never 400
    status, _, _ = post(daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 3, "deadline_ms": 600_000})
    assert status == 200
    status, headers, answer = post(
        daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 3, "deadline_ms": 1e-6}
    )
    assert status in (200, 429), (status, answer)
    if status == 429:
        assert answer["error"]["code"] == "overloaded" and int(headers["Retry-After"]) >= 1
    no_traceback(daemon)


@pytest.mark.slow
def test_a_burst_of_500_is_answered_with_a_status_each_and_counted_in_metrics_and_telemetry(daemon):
    post(daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 4})  # the rates are measured
    results = burst(daemon, 500)
    by_status = check_answers(results, 500)
    print(f"burst of 500: {dict(by_status)}")
    assert by_status[200] >= 1, by_status  # the first ones fit
    assert by_status[429] + by_status[503] >= 1, by_status  # and 500 at once do not all fit
    wait_for(lambda: health(daemon)["waiting"] == 0 and health(daemon)["running"] == 0, 30, what="no stuck row")
    assert served_again(daemon)["choices"][0]["message"]["content"] is not None

    # Every 429 at admission is counted once in /metrics, and the telemetry windows add up to the same.
    refused_http = sum(1 for r in results if r[0] == 429)
    refused_metrics = metric(daemon, "edge_agent:requests_refused_total")
    assert refused_metrics >= refused_http  # served_again may have been refused too

    def in_windows() -> int:
        docs = daemon.listener.of("tele/latency")
        return sum(r["count"] for d in docs for r in (d.get("admission") or {}).get("refused", []))

    wait_for(lambda: in_windows() == refused_metrics, 30, what=f"{refused_metrics:.0f} refusals in the windows")
    assert all("admission" in d for d in daemon.listener.of("tele/latency"))
    no_traceback(daemon)


def test_a_client_that_leaves_while_waiting_frees_its_place_at_once(tmp_path, broker):
    # One row, long replies, no admission refusals (the waiters must wait) and no shedding.
    port = free_port()
    cfg = config_text(tmp_path / "agent", broker.port, port, target_ms=600_000)
    cfg = cfg.replace("max_new_tokens = 48\nmax_batch = 2", "max_new_tokens = 3000\nmax_batch = 1")
    daemon = Daemon(
        tmp_path / "agent", broker_port=broker.port, config=cfg, api_port=port, extra="[batching]\nadmission = false\n"
    )
    daemon.start()
    held: list[socket.socket] = []
    try:

        def open_stream(content: str, max_tokens: int) -> socket.socket:
            """A streamed chat on a raw socket (so the test decides when the client leaves)."""
            body = json.dumps(
                {
                    "model": "small",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
            ).encode()
            s = socket.create_connection(("127.0.0.1", daemon.api_port), timeout=60)
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            held.append(s)
            return s

        running = open_stream("the long one", 3000)
        wait_for(lambda: health(daemon)["running"] == 1, 30, what="the first chat running")
        leaver = open_stream("I will leave", 8)
        wait_for(lambda: health(daemon)["waiting"] == 1, 30, what="one waiter")
        stayer = open_stream("I will stay", 8)
        wait_for(lambda: health(daemon)["waiting"] == 2, 30, what="two waiters")

        leaver.close()  # the client leaves while it waits
        wait_for(lambda: health(daemon)["waiting"] == 1, 10, what="the leaver's place freed")
        h = health(daemon)
        assert (h["running"], h["waiting"]) == (1, 1), h  # freed while the long one still runs: at once
        running.settimeout(0.01)
        try:
            assert b"[DONE]" not in running.recv(1 << 20)
        except TimeoutError:
            pass

        running.close()  # the row frees: the next waiter starts and is served to its end
        stayer.settimeout(60)
        reply = b""
        while b"data: [DONE]" not in reply:
            chunk = stayer.recv(1 << 16)
            assert chunk, f"the stayer's stream ended early: {reply[-500:]!r}"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b'"error"' not in reply, reply[:500]
        wait_for(lambda: health(daemon)["waiting"] == 0 and health(daemon)["running"] == 0, 30, what="no stuck row")
        status, _, _ = post(daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 4})
        assert status == 200
        no_traceback(daemon)
    finally:
        for s in held:
            s.close()
        print(daemon.close()[-3000:])


@pytest.mark.slow
def test_a_sighup_and_a_fleet_pin_during_a_burst(tmp_path, broker):
    from tests.faults.test_desired import command

    port = free_port()
    cfg = config_text(tmp_path / "agent", broker.port, port) + SLA
    cfg = cfg.replace("[mqtt]", TWO_TIERS + "\n[mqtt]")
    daemon = start_daemon(tmp_path, broker, extra="", config=cfg, api_port=port)
    try:
        post(daemon, {"model": "small", "messages": MESSAGES, "max_tokens": 4})
        answered: list[int] = []
        results: list[tuple] = []
        runner = threading.Thread(target=lambda: results.extend(burst(daemon, 300, answered)), daemon=True)
        runner.start()
        wait_for(lambda: answered, 60, what="the burst's first answer")
        daemon.signal(signal.SIGHUP)
        at_sighup = len(answered)
        command(broker, daemon, "pin_tier", "pin-burst", {"workload": "llm", "tier": "light"})
        at_pin = len(answered)
        runner.join(180)
        assert not runner.is_alive(), "the burst did not end"
        print(f"burst of 300, SIGHUP after {at_sighup} answers, pinned after {at_pin}: {check_answers(results, 300)}")
        assert at_sighup < 300, "the burst was over before the SIGHUP"
        wait_for(lambda: daemon.notify.seen("STATUS", contains="reloaded"), 30, what="the reload")
        wait_for(lambda: health(daemon)["tier"] == "light", 60, what="the pinned tier serving")
        wait_for(lambda: health(daemon)["waiting"] == 0 and health(daemon)["running"] == 0, 30, what="no stuck row")
        assert served_again(daemon)["choices"][0]["message"]["content"] is not None
        assert health(daemon)["tier"] == "light"  # the pin holds
        no_traceback(daemon)
    finally:
        print(daemon.close()[-3000:])


def test_a_preempted_chat_whose_client_leaves_frees_its_row_and_the_voice_turn_keeps_its_tokens(tmp_path):
    from edge_agent.backends import SessionOptions
    from edge_agent.models.catalog import resolve_model
    from edge_agent.models.llm import DecoderLM
    from edge_agent.models.sampling import SamplingParams
    from edge_agent.serving.llm.admission import INTERACTIVE
    from edge_agent.serving.llm.scheduler import Limits
    from edge_agent.serving.llm.tiers import Tier, TieredLLM

    folder = resolve_model("demo-phi3", tmp_path)
    ladder = TieredLLM(
        [
            Tier(
                "only",
                lambda: DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1)),
                Limits(max_batch=1, batch_timeout_ms=0),
                2000,
            )
        ]
    )
    preempted = threading.Event()
    ladder.on_preempted = preempted.set  # as the daemon counts it in /metrics
    ladder.start()
    try:
        chat = ladder.submit("a long chat", SamplingParams(max_new_tokens=2000, ignore_eos=True), raw=True)
        events = iter(chat)
        for _ in range(3):  # it holds the only row
            next(events)
        voice = ladder.submit(
            "turn on the light", SamplingParams(max_new_tokens=4, ignore_eos=True), raw=True, tags=(INTERACTIVE,)
        )
        assert preempted.wait(30), "the voice turn did not preempt the chat"
        chat.cancel()  # the preempted chat's client leaves
        voice_done = voice.result(30)
        chat_done = chat.result(30)
        assert chat_done.finish_reason == "cancelled", chat_done.finish_reason
        assert len(chat_done.token_ids) < 2000
        wait_for(lambda: ladder.load == (0, 0), 30, what="no stuck row")
        # the voice turn's tokens are those it gets alone on an idle ladder; so are the next chat's
        alone = ladder.submit("turn on the light", SamplingParams(max_new_tokens=4, ignore_eos=True), raw=True)
        assert voice_done.token_ids == alone.result(30).token_ids and len(voice_done.token_ids) == 4
        after = ladder.submit("hello again", SamplingParams(max_new_tokens=6, ignore_eos=True), raw=True).result(30)
        assert after.finish_reason == "length" and len(after.token_ids) == 6
        assert ladder.load == (0, 0)
    finally:
        ladder.stop()
