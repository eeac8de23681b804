"""Remote commands from the fleet (``cmd/<name>/req``) and its ``desired`` state, executed through a small seam.

Lifecycle of one request, one response message per step, on the MQTT 5 response topic (else
``cmd/<name>/res``) with the request's correlation data:

    received ─▶ rejected                      (oversized, unsigned / expired / bad signature when a fleet
       │                                       key is set, response topic outside the allow-list, not
       │                                       JSON, bad schema, unknown or not allowed command,
       │                                       invalid arguments, unknown tier or recipe)
       ├──────▶ expired                       (message expiry or ``expires_at_wall`` passed)
       └─▶ accepted ─▶ executing ─▶ succeeded | failed | expired

Trust: replies go only to this device's own reply topics (``<prefix>/cmd/<name>/res[/...]``,
``<prefix>/res/...``) or under ``telemetry.reply_prefixes``; any other MQTT 5 response topic (e.g.
another device's ``state``) is refused with a reason on ``cmd/<name>/res``. With a fleet key
(``signing.Verifier``) commands and ``desired`` must carry a valid, unexpired signature. Only
``telemetry.commands_allowed`` run.

A ``cmd_id`` already in the ledger is never run again: the stored final response is re-sent with
``duplicate: true``. Only allow-listed commands exist; none takes a file path, and tiers / engine
recipes must be ones the device has configured (``CommandTarget.tiers`` / ``recipes``).

``desired`` (retained, versioned, laid over the local config file) is the overlay half,
``desired.DesiredOverlay``, which ``CommandProcessor`` inherits: see that module.

Threading: ``submit`` runs on paho's thread and only enqueues (bounded); one worker thread does
the rest, so a slow ``rebuild_engine`` never stalls the network loop. A flood is logged at most
once per ``LOG_EVERY_S`` per reason, and dropped messages (and envelopes that cannot be read, though
each is still answered) are counted in a ``commands_dropped`` event (``on_drops``) at most once per
``LOG_EVERY_S``. No message, whatever its bytes, raises out of ``handle``: an envelope the verifier
cannot read is a refusal like any other (``signing.Malformed``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from ..config.sla import sla_metric_problem
from ..logsetup import LOG_EVERY_S, LogLimiter
from .client import Incoming
from .command_args import (
    ALLOWED,
    CommandArgs,
    CommandTarget,
    NoArgs,
    PinTierArgs,
    RebuildArgs,
    Rejected,
    SetSlaArgs,
    WorkloadArgs,
    describe,
)
from .desired import DesiredOverlay
from .ledger import Ledger
from .schema import CommandRequest, CommandResponse
from .signing import Malformed, Unsigned, Verifier, unwrap

log = logging.getLogger(__name__)

MAX_QUEUE = 256


class CommandProcessor(DesiredOverlay):
    """Fleet commands for one device (see the module doc): ``submit`` on paho's thread, the rest on
    the worker; the ``desired`` overlay comes from ``desired.DesiredOverlay``."""

    def __init__(
        self,
        target: CommandTarget,
        ledger: Ledger,
        prefix: str,
        device_id: str,
        respond: Callable[[str, bytes, bytes | None], None],
        publish_reported: Callable[[dict[str, Any]], None] = lambda _r: None,
        *,
        max_bytes: int = 16 * 1024,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        verifier: Verifier | None = None,
        allowed: Sequence[str] | None = None,
        reply_prefixes: Sequence[str] = (),
        on_drops: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.target, self.ledger, self.prefix, self.device_id = target, ledger, prefix, device_id
        self.respond, self.publish_reported = respond, publish_reported
        self.max_bytes, self.clock, self.wall = max_bytes, clock, wall
        self.verifier = verifier or Verifier(None, wall)
        self.allowed = frozenset(ALLOWED if allowed is None else allowed)
        self.reply_prefixes = tuple(reply_prefixes)
        self.on_drops = on_drops
        self.limited = LogLimiter(clock=clock, logger=log)
        self._drops: dict[str, int] = {}  # not yet reported in a commands_dropped event
        self._drops_lock = threading.Lock()
        self._drops_reported_at: float | None = None
        self._queue: queue.Queue[tuple[Incoming, float] | None] = queue.Queue(MAX_QUEUE)
        self._thread: threading.Thread | None = None
        self.stats = {
            "handled": 0,
            "rejected": 0,
            "duplicates": 0,
            "expired": 0,
            "failed": 0,
            "succeeded": 0,
            "overflow": 0,
            "dropped": 0,
            "unsigned": 0,
            "malformed": 0,
            "errors": 0,
        }
        self._init_desired()

    # -- threads ------------------------------------------------------------------------------------

    def submit(self, msg: Incoming) -> None:
        """paho thread: enqueue only."""
        try:
            self._queue.put_nowait((msg, self.clock()))
        except queue.Full:
            self.stats["overflow"] += 1
            self._dropped("queue_full")
            self.limited(
                logging.ERROR, "queue_full", "command queue full (%d); dropped a message on %s", MAX_QUEUE, msg.topic
            )

    def _dropped(self, reason: str) -> None:
        with self._drops_lock:
            self.stats["dropped"] += 1
            self._drops[reason] = self._drops.get(reason, 0) + 1

    def report_drops(self, force: bool = False) -> None:
        """Worker thread: one ``commands_dropped`` event with the counts since the last one, at most
        once per ``LOG_EVERY_S`` (the first drop after a quiet period is reported at once)."""
        now = self.clock()
        with self._drops_lock:
            due = force or self._drops_reported_at is None or now - self._drops_reported_at >= LOG_EVERY_S
            if not self._drops or not due:
                return
            counts, self._drops = self._drops, {}
            self._drops_reported_at = now
            total = self.stats["dropped"]
        if self.on_drops is not None:
            try:
                self.on_drops({"counts": counts, "total": total, "period_s": LOG_EVERY_S})
            except Exception:
                self.stats["errors"] += 1
                log.exception("reporting dropped commands failed")

    def start(self) -> CommandProcessor:
        self._thread = threading.Thread(target=self._run, name="commands", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                self.report_drops()
                continue
            if item is None:
                self.report_drops(force=True)
                return
            try:
                self.handle(*item)
            except Exception:  # one bad message must not end command handling
                self.stats["errors"] += 1
                log.exception("command handling failed for %s", item[0].topic)
            self.report_drops()

    # -- one message --------------------------------------------------------------------------------

    def handle(self, msg: Incoming, received_mono: float | None = None) -> None:
        """One message: ``desired``, or a request taken through the lifecycle of the module doc."""
        received_mono = self.clock() if received_mono is None else received_mono
        if msg.topic == f"{self.prefix}/desired":
            self._desired(msg)
            return
        name = self._command_name(msg.topic)
        if name is None:
            return
        self.stats["handled"] += 1
        own = f"{self.prefix}/cmd/{name}/res"
        bad_reply = msg.response_topic is not None and not self.reply_allowed(msg.response_topic)
        send = self._sender(
            own if bad_reply or not msg.response_topic else msg.response_topic, msg.correlation_data, name
        )
        payload = self._open(msg, bad_reply, send)
        if payload is None:
            return
        req = self._parse(msg, payload, send)
        if req is None:
            return
        deadline = received_mono + msg.expiry_s if msg.expiry_s is not None else None
        self._run_request(name, req, deadline, send)

    def _command_name(self, topic: str) -> str | None:
        """``<name>`` of ``<prefix>/cmd/<name>/req``; any other topic is dropped (None)."""
        parts = topic[len(self.prefix) + 1 :].split("/") if topic.startswith(self.prefix + "/") else []
        if len(parts) != 3 or parts[0] != "cmd" or parts[2] != "req":
            self._dropped("unexpected_topic")
            self.limited(logging.WARNING, "topic", "ignored message on unexpected topic %s", topic)
            return None
        return parts[1]

    def _open(self, msg: Incoming, bad_reply: bool, send: Callable[..., bytes]) -> bytes | None:
        """The request inside the message's envelope; None (answered ``rejected``) when the message is
        oversized, asks for a reply topic not allowed, or is unsigned or not signed as the fleet key says."""
        # An envelope carries the request in base64 (4/3) plus a signature; the request is checked after.
        if len(msg.payload) > 2 * self.max_bytes:
            send(None, "rejected", f"payload is {len(msg.payload)} bytes, over the {self.max_bytes}-byte limit")
            return None
        unsigned: str | None = None
        malformed = False
        try:
            payload = self.verifier.open(msg.topic, msg.payload)
        except Unsigned as exc:  # the verifier raises nothing else, whatever the bytes
            unsigned, payload, malformed = str(exc), _unchecked(msg.payload), isinstance(exc, Malformed)
        if bad_reply:
            reason = (
                f"response topic {(msg.response_topic or '')[:200]!r} is not one of this device's reply topics "
                f"({self.prefix}/cmd/<name>/res[/...], {self.prefix}/res/...) nor under "
                f"telemetry.reply_prefixes ({', '.join(self.reply_prefixes) or 'none'}); not run"
            )
            send(_peek_cmd_id(payload), "rejected", reason)
            self.limited(logging.WARNING, "reply_topic", "refused command %s: %s", msg.topic, reason)
            return None
        if unsigned is not None:
            self.stats["unsigned"] += 1
            send(_peek_cmd_id(payload), "rejected", unsigned)
            if malformed:  # junk rather than a forgery: counted with the drops, so a flood of it shows
                self.stats["malformed"] += 1
                self._dropped("malformed_envelope")
            key = "malformed_envelope" if malformed else "unsigned"
            self.limited(logging.WARNING, key, "refused command %s: %s", msg.topic, unsigned)
            return None
        return payload

    def _parse(self, msg: Incoming, payload: bytes, send: Callable[..., bytes]) -> CommandRequest | None:
        """The request read from ``payload``; None (answered ``rejected``) when oversized or malformed."""
        if len(payload) > self.max_bytes:
            send(None, "rejected", f"payload is {len(payload)} bytes, over the {self.max_bytes}-byte limit")
            return None
        try:
            return CommandRequest.model_validate_json(payload)
        except ValidationError as exc:
            cmd_id = _peek_cmd_id(payload)
            send(cmd_id, "rejected", f"malformed request: {describe(exc)}")
            self.limited(
                logging.WARNING,
                "malformed",
                "rejected malformed command %s (cmd_id %r): %s",
                msg.topic,
                cmd_id,
                describe(exc),
            )
            return None

    def _run_request(self, name: str, req: CommandRequest, deadline: float | None, send: Callable[..., bytes]) -> None:
        """A readable request: a duplicate answered from the ledger, else expired | rejected, or accepted,
        executing, then succeeded | failed | expired."""
        seen = self.ledger.lookup(req.cmd_id)
        if seen is not None:
            self._duplicate(req.cmd_id, name, seen, send)
            return
        if self._expired(req, deadline):
            send(req.cmd_id, "expired", "the request expired before it could run", final=True)
            return
        try:
            args = self._validate(name, req.args)
        except Rejected as exc:
            send(req.cmd_id, "rejected", str(exc), final=True)
            return
        send(req.cmd_id, "accepted", None)
        if self._expired(req, deadline):
            send(req.cmd_id, "expired", "the request expired while queued", final=True)
            return
        send(req.cmd_id, "executing", None)
        try:
            result = _EXECUTE[name](self, args)
        except Exception as exc:  # the target reports failure by raising; its message goes back
            log.warning("command %s (%s) failed: %s", name, req.cmd_id, exc)
            send(req.cmd_id, "failed", str(exc) or type(exc).__name__, final=True)
            return
        send(req.cmd_id, "succeeded", None, result=_jsonable(result), final=True)
        if name in REPORTED_AFTER:
            self._report()

    def reply_allowed(self, topic: str) -> bool:
        """This device's own reply topics, or under a configured fleet reply prefix: never another
        device's topics, nor this device's own ``state`` / ``tele`` / ``cmd/.../req``."""
        if not _publishable(topic):
            return False
        if topic.startswith(self.prefix + "/"):
            rest = topic[len(self.prefix) + 1 :].split("/")
            return (len(rest) >= 3 and rest[0] == "cmd" and rest[2] == "res") or (len(rest) >= 2 and rest[0] == "res")
        return any(topic.startswith(p) for p in self.reply_prefixes)

    def _sender(self, topic: str, correlation: bytes | None, name: str):
        def send(
            cmd_id: str | None,
            status: str,
            reason: str | None,
            *,
            result: dict | None = None,
            final: bool = False,
            duplicate: bool = False,
        ) -> bytes:
            body = CommandResponse(
                device_id=self.device_id,
                cmd_id=cmd_id,
                command=name[:64],
                status=status,
                reason=reason[:1024] if reason else None,
                result=result,
                duplicate=duplicate,
                at_wall=self.wall(),
            ).to_json()
            # Rejections are not recorded: nothing ran, and a corrected retry may reuse the cmd_id.
            if cmd_id is not None and not duplicate and status != "rejected":
                self.ledger.record(cmd_id, name, status, body if final else None)
            if status in ("rejected", "expired", "failed", "succeeded"):
                self.stats[status] += 1
            self.respond(topic, body, correlation)
            return body

        return send

    def _duplicate(self, cmd_id: str, name: str, seen: tuple[str, str, bytes | None], send) -> None:
        self.stats["duplicates"] += 1
        command, status, stored = seen
        if command != name:
            send(cmd_id, "rejected", f"cmd_id {cmd_id} was already used for {command!r}", duplicate=True)
            return
        if stored is not None:
            doc = json.loads(stored)
            send(cmd_id, doc["status"], doc.get("reason"), result=doc.get("result"), duplicate=True)
        else:
            send(
                cmd_id,
                status,
                "interrupted: the agent restarted while this command ran; whether it took effect is unknown",
                duplicate=True,
            )

    def _expired(self, req: CommandRequest, deadline: float | None) -> bool:
        if deadline is not None and self.clock() > deadline:
            return True
        return req.expires_at_wall is not None and self.wall() > req.expires_at_wall

    def _validate(self, name: str, raw: dict[str, Any]) -> CommandArgs:
        model = ALLOWED.get(name)
        if model is None:
            raise Rejected(f"unknown command {name!r}; known: {', '.join(sorted(ALLOWED))}")
        if name not in self.allowed:
            raise Rejected(
                f"command {name!r} is not allowed on this device (telemetry.commands_allowed: "
                f"{', '.join(sorted(self.allowed)) or 'none'})"
            )
        try:
            args = model.model_validate(raw)
        except ValidationError as exc:
            raise Rejected(f"invalid arguments: {describe(exc, 'args.')}") from None
        tiers = self.target.tiers()
        workload = getattr(args, "workload", None)
        if workload is not None and workload not in tiers:
            raise Rejected(f"unknown workload {workload!r}; configured: {', '.join(sorted(tiers))}")
        if isinstance(args, PinTierArgs) and args.tier not in tiers[args.workload]:
            raise Rejected(
                f"tier {args.tier!r} is not configured for {args.workload}; "
                f"configured: {', '.join(tiers[args.workload])}"
            )
        if isinstance(args, SetSlaArgs):
            problem = sla_metric_problem(args.workload, args.sla.metric)
            if problem is not None:  # refused before it runs: the controller would never get a sample
                raise Rejected(f"args.sla.metric: {problem}")
        if isinstance(args, RebuildArgs) and args.recipe not in self.target.recipes():
            raise Rejected(
                f"recipe {args.recipe!r} is not configured; configured: {', '.join(self.target.recipes()) or '(none)'}"
            )
        return args


# Each allowed command (``ALLOWED``) and what runs it, given its validated arguments.


def _set_sla(p: CommandProcessor, args: SetSlaArgs) -> dict[str, Any]:
    return p.target.set_sla(args.workload, args.sla)


def _pin_tier(p: CommandProcessor, args: PinTierArgs) -> dict[str, Any]:
    return p.target.pin_tier(args.workload, args.tier)


def _unpin_tier(p: CommandProcessor, args: WorkloadArgs) -> dict[str, Any]:
    return p.target.unpin_tier(args.workload)


def _rebuild_engine(p: CommandProcessor, args: RebuildArgs) -> dict[str, Any]:
    return p.target.rebuild_engine(args.recipe)


def _reset_desired(p: CommandProcessor, args: NoArgs) -> dict[str, Any]:
    result = p.reset_desired()
    return result if isinstance(result, dict) else {"desired_version": None}


_EXECUTE: dict[str, Callable[[CommandProcessor, Any], dict[str, Any]]] = {
    "get_status": lambda p, args: p.target.status(),
    "set_sla": _set_sla,
    "pin_tier": _pin_tier,
    "unpin_tier": _unpin_tier,
    "rebuild_engine": _rebuild_engine,
    "flush_telemetry": lambda p, args: p.target.flush_telemetry(),
    "reset_desired": _reset_desired,
}
REPORTED_AFTER = frozenset({"set_sla", "pin_tier", "unpin_tier", "reset_desired"})  # change what `reported` says


def _publishable(topic: str | None) -> bool:
    return topic is not None and 0 < len(topic) <= 512 and not any(c in topic for c in "+#\0")


def _unchecked(payload: bytes) -> bytes:
    """The request inside an envelope whose signature failed: read only to echo its ``cmd_id``."""
    try:
        env = unwrap(payload)
    except Unsigned:  # unwrap raises nothing else
        return payload
    return env[0] if env is not None else payload


def _peek_cmd_id(payload: bytes) -> str | None:
    try:
        doc = json.loads(payload)
        value = doc.get("cmd_id") if isinstance(doc, dict) else None
        return value[:64] if isinstance(value, str) and value.isprintable() else None
    except (ValueError, UnicodeDecodeError, RecursionError):  # whatever the bytes: no id to echo
        return None


def _jsonable(result: Any) -> dict[str, Any]:
    if not isinstance(result, dict):
        result = {"value": result}
    return json.loads(json.dumps(result, default=str))
