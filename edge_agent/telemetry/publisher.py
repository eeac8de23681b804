"""The telemetry thread: seals a window every ``interval_s``, spools it, pumps the spool to MQTT.

One thread owns the spool. Each turn of its loop:
1. every ``interval_s`` (monotonic clock) take the accumulator's window and append a
   ``tele/latency`` record, then append queued events and ``spool_drop`` reports;
2. apply PUBACKs the link queued: below 0x80 → delete from the spool, else ``Spool.reject``;
3. if connected, publish: first *live* records (appended by this process less than ``live_age_s``
   ago) as they are, then the backlog oldest-first with ``historical: true``, at most
   ``replay_per_s`` per second, never more than ``max_inflight`` unacknowledged in all.

So after an outage the backlog drains at a bounded rate while live windows keep flowing, and a
receiver can tell them apart.

A full disk degrades, never stops, the loop: windows that cannot be stored are lost and reported
(the spool keeps the report until its event is stored), queued events wait in memory, and
``on_degraded`` hears each change of ``Spool.degraded`` (the service turns it into ``state``). A turn
that raises is logged once per run of failures and retried after a back-off, never in a tight loop.

Messages unacknowledged for ``inflight_timeout_s`` become eligible again (paho retransmits its own on
reconnect; a second copy is harmless: ``seq`` dedups).

Timestamps: window boundaries come from the injected monotonic ``clock``; wall times are reported
beside them, with ``clock_synced`` (kernel NTP state) and ``clock_jump_s`` when the wall clock moved
more than 1 s differently from the monotonic one within a window (a ``clock_jump`` event too).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import MqttLink
from .schema import Admission, Event, Health, LatencyWindow, WindowTimes
from .spool import Kind, Record, Spool
from .windows import WindowAccumulator

log = logging.getLogger(__name__)

CLOCK_JUMP_S = 1.0
MAX_QUEUED_EVENTS = 1000
ERROR_BACKOFF_MIN_S, ERROR_BACKOFF_MAX_S = 0.5, 30.0


def kernel_clock_synced() -> bool:
    """True when the kernel says NTP keeps the clock synchronised (adjtimex state != TIME_ERROR)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(512)  # struct timex, modes = 0: read only
        return libc.adjtimex(buf) not in (-1, 5)
    except (OSError, AttributeError):
        return False


def read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()[:64]
    except OSError:
        return "unknown"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who publishes: the device id, the agent's version and this boot's id."""

    device_id: str
    version: str
    boot_id: str


class Publisher:
    """The telemetry thread's loop: seal windows, spool them, publish live then backlog (see the module doc)."""

    def __init__(
        self,
        link: MqttLink | None,
        spool: Spool,
        accumulator: WindowAccumulator,
        identity: Identity,
        *,
        interval_s: float = 10.0,
        replay_per_s: float = 5.0,
        replay_burst: int = 10,
        live_age_s: float | None = None,
        max_inflight: int = 20,
        inflight_timeout_s: float = 60.0,
        reject_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        clock_synced: Callable[[], bool] = kernel_clock_synced,
        on_degraded: Callable[[str | None], None] | None = None,
        health: Callable[[], dict[str, Any]] | None = None,
        admission: Callable[[], Admission] | None = None,
    ) -> None:
        """``on_degraded`` hears the spool become degraded (why) or fine again (None); ``health`` gives
        the device's health as each window is sealed (None leaves it out of the windows);
        ``admission`` the refusals and preemptions since the last window (None leaves them out)."""
        self.link, self.spool, self.acc, self.identity = link, spool, accumulator, identity
        self.on_degraded, self.health, self.admission = on_degraded, health, admission
        self.interval_s = interval_s
        self.replay_per_s, self.replay_burst = replay_per_s, replay_burst
        self.live_age_s = live_age_s if live_age_s is not None else max(2.0 * interval_s, 5.0)
        self.max_inflight, self.inflight_timeout_s = max_inflight, inflight_timeout_s
        self.reject_backoff_s = reject_backoff_s
        self.clock, self.wall, self.clock_synced = clock, wall, clock_synced
        self._events: deque[tuple[str, dict, float, float]] = deque(maxlen=MAX_QUEUED_EVENTS)
        self._fresh: deque[tuple[int, float]] = deque()  # (record id, appended at, monotonic)
        self._inflight: dict[int, tuple[int, float]] = {}  # mid -> (record id, sent at)
        self._retry_at: dict[int, float] = {}
        self._tokens = float(replay_burst)
        self._tokens_at = clock()
        self._generation = -1
        self._window_start = (clock(), wall())
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flush = threading.Event()
        self._thread: threading.Thread | None = None
        self._degraded: str | None = None
        if link is not None:
            link.on_ack = self._wake.set
        self.stats = {
            "windows": 0,
            "events": 0,
            "published_live": 0,
            "published_historical": 0,
            "acked": 0,
            "rejected": 0,
            "events_dropped": 0,
            "loop_errors": 0,
        }

    # -- API for other threads ---------------------------------------------------------------------

    def emit_event(self, type_: str, data: dict[str, Any] | None = None) -> None:
        """Queue an ``evt/<type>`` (thread-safe, never blocks; bounded: the oldest is dropped)."""
        if len(self._events) == self._events.maxlen:
            self.stats["events_dropped"] += 1
        self._events.append((type_, dict(data or {}), self.wall(), self.clock()))
        self._wake.set()

    def flush(self) -> None:
        """Seal the current window now instead of at the next interval."""
        self._flush.set()
        self._wake.set()

    def start(self) -> Publisher:
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = self.clock() + self.interval_s
        failing, backoff = 0, ERROR_BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                now = self.clock()
                if now >= next_tick or self._flush.is_set():
                    self._flush.clear()
                    # Scheduled before sealing: a seal that raises must not be retried at once.
                    next_tick = (
                        max(next_tick + self.interval_s, now + self.interval_s / 2) if now >= next_tick else next_tick
                    )
                    self.seal_window()
                self.drain_events()
                busy = self.pump()
                self.check_health()
            except Exception:  # the telemetry thread must outlive any one bad turn
                self.stats["loop_errors"] += 1
                if failing == 0:  # one traceback per run of failures, then a back-off
                    log.exception("telemetry loop error; retrying with a back-off up to %.0f s", ERROR_BACKOFF_MAX_S)
                failing += 1
                self._wake.wait(backoff)
                backoff = min(ERROR_BACKOFF_MAX_S, backoff * 2)
                self._wake.clear()
                continue
            if failing:
                log.warning("telemetry loop working again after %d failed turns", failing)
                failing, backoff = 0, ERROR_BACKOFF_MIN_S
            wait = 0.02 if busy else min(0.25, max(0.0, next_tick - self.clock()))
            self._wake.wait(wait)
            self._wake.clear()

    def check_health(self) -> None:
        """Tell ``on_degraded`` when the spool became degraded or fine again (once per change)."""
        degraded = self.spool.degraded
        if (degraded is None) != (self._degraded is None):
            self._degraded = degraded
            if self.on_degraded is not None:
                self.on_degraded(degraded)

    def seal_window(self) -> Record | None:
        """Take the accumulated window and spool it as one ``tele/latency`` record."""
        start_mono, start_wall = self._window_start
        end_mono, end_wall = self.clock(), self.wall()
        self._window_start = (end_mono, end_wall)
        duration = max(0.0, end_mono - start_mono)
        drift = (end_wall - start_wall) - duration
        jump = drift if abs(drift) > CLOCK_JUMP_S else None
        series = [s.to_series(duration) for s in self.acc.take()]
        synced = bool(self.clock_synced())
        ident = self.identity
        health = None
        if self.health is not None:
            try:
                health = Health.model_validate(self.health())
            except Exception:  # health explains a window; it must never cost one
                log.warning("device health could not be read for this window", exc_info=True)
        admission = None
        if self.admission is not None:
            try:
                admission = self.admission()
            except Exception:  # the counts explain a window; they must never cost one
                log.warning("refusals and preemptions could not be read for this window", exc_info=True)

        def build(seq: int) -> bytes:
            return LatencyWindow(
                device_id=ident.device_id,
                session=self.spool.session,
                boot_id=ident.boot_id,
                seq=seq,
                clock_synced=synced,
                clock_jump_s=jump,
                window=WindowTimes(
                    start_wall=start_wall,
                    end_wall=end_wall,
                    start_mono=start_mono,
                    end_mono=end_mono,
                    duration_s=duration,
                ),
                series=series,
                version=ident.version,
                health=health,
                admission=admission,
            ).to_json()

        record = self._append("window", "tele/latency", build)
        self.stats["windows"] += 1
        if jump is not None:
            log.warning("wall clock jumped %.1f s against the monotonic clock", jump)
            self.emit_event("clock_jump", {"jump_s": jump, "clock_synced": synced})
        return record

    def drain_events(self) -> None:
        """Store queued events, then the spool's loss reports. What the disk cannot take now stays
        queued (events here, loss reports in the spool) for a later turn."""
        while self._events:
            item = self._events.popleft()
            if not self._append_event(*item):
                self._events.appendleft(item)
                return
        self.spool.report_drops(
            lambda drop: self._append_event("spool_drop", drop.model_dump(), self.wall(), self.clock())
        )

    def _append_event(self, type_: str, data: dict, at_wall: float, at_mono: float) -> bool:
        """True when stored (or refused as malformed: retrying would not help); False on a full disk."""
        ident = self.identity

        def build(seq: int) -> bytes:
            return Event(
                device_id=ident.device_id,
                type=type_,
                session=self.spool.session,
                seq=seq,
                at_wall=at_wall,
                at_mono=at_mono,
                data=data,
            ).to_json()

        try:
            if self._append("event", f"evt/{type_}", build, keep=True) is None:
                return False
            self.stats["events"] += 1
        except ValueError as exc:  # a malformed event from a caller must not stop telemetry
            log.error("event %r not sent: %s", type_, exc)
        return True

    def _append(self, kind: Kind, suffix: str, build: Callable[[int], bytes], keep: bool = False) -> Record | None:
        topic = f"{self.link.prefix}/{suffix}" if self.link else suffix
        record = self.spool.append(kind, topic, build, keep=keep)
        if record is not None:
            self._fresh.append((record.id, self.clock()))
        return record

    # -- pumping ------------------------------------------------------------------------------------

    def pump(self) -> bool:
        """Apply acks and publish what may go now; True while there is more to send."""
        link = self.link
        if link is None:
            return False
        now = self.clock()
        self._apply_acks(link, now)
        if link.generation != self._generation:
            self._generation = link.generation
            # Sent-before-reconnect messages get a fresh timeout: paho retransmits them itself.
            self._inflight = {mid: (rid, now) for mid, (rid, _t) in self._inflight.items()}
        for mid, (_rid, sent) in list(self._inflight.items()):
            if now - sent > self.inflight_timeout_s:
                del self._inflight[mid]
        # Records too old to be live are left to the backlog pass (also keeps _fresh bounded offline).
        while self._fresh and now - self._fresh[0][1] > self.live_age_s:
            self._fresh.popleft()
        if not link.connected.is_set():
            return False
        busy_ids = {rid for rid, _t in self._inflight.values()}
        # Live first.
        while self._fresh and len(self._inflight) < self.max_inflight:
            rid, _appended = self._fresh.popleft()
            if rid in busy_ids:
                continue
            rows = self.spool.pending(1, after_id=rid - 1)
            if rows and rows[0].id == rid and self._send(link, rows[0], False, now):
                busy_ids.add(rid)
        # Then the backlog, rate-limited.
        self._refill(now)
        room = min(self.max_inflight - len(self._inflight), int(self._tokens))
        backlog = False
        if room > 0:
            fresh_ids = {rid for rid, _t in self._fresh}
            skip = busy_ids | fresh_ids | {rid for rid, t in self._retry_at.items() if t > now}
            rows = self.spool.pending(room, exclude=skip)
            for row in rows:
                if self._send(link, row, True, now):
                    self._tokens -= 1
            backlog = len(rows) == room
        else:
            backlog = self.spool.records > len(self._inflight)
        return backlog or bool(self._fresh)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._tokens_at)  # an injected clock may jump back: never negative
        self._tokens = min(float(self.replay_burst), self._tokens + elapsed * self.replay_per_s)
        self._tokens_at = now

    def _send(self, link: MqttLink, record: Record, historical: bool, now: float) -> bool:
        payload = record.payload
        if historical:
            try:
                doc = json.loads(payload)
                doc["historical"] = True
                payload = json.dumps(doc, separators=(",", ":")).encode()
            except ValueError:  # CRC passed, so this cannot happen unless a writer bug stored junk
                log.error("spooled record %d is not JSON; sending as stored", record.id)
        mid = link.publish(record.topic, payload, qos=1)
        if mid is None:
            return False
        self._inflight[mid] = (record.id, now)
        self._retry_at.pop(record.id, None)
        self.stats["published_historical" if historical else "published_live"] += 1
        return True

    def _apply_acks(self, link: MqttLink, now: float) -> None:
        acked = []
        for mid, code in link.drain_acks():
            entry = self._inflight.pop(mid, None)
            if entry is None:
                continue  # a birth message or a retransmission already settled
            if code < 0x80:
                acked.append(entry[0])
            else:
                self.stats["rejected"] += 1
                log.warning("broker refused record %d (reason 0x%02x)", entry[0], code)
                if self.spool.reject(entry[0], code):
                    self._retry_at.pop(entry[0], None)  # dropped for good (and reported)
                else:
                    self._retry_at[entry[0]] = now + self.reject_backoff_s
        if acked:
            self.stats["acked"] += self.spool.ack(acked)

    @property
    def inflight(self) -> int:
        return len(self._inflight)
