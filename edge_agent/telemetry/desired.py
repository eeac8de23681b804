"""The fleet's ``desired`` state, laid over the local config file: the overlay half of the remote
command processor (``remote_commands.CommandProcessor`` inherits it).

``desired`` (retained, versioned) is applied all-or-nothing when its version is newer than the last
applied one, and echoed through ``publish_reported``. The applied document is kept in the ledger
(``DESIRED_DOC_KEY``, its version under ``DESIRED_KEY``) and put back in force after a restart
(``restore_desired``, before the broker's retained copy of the same version, which is then a no-op)
and after a reload of the file (``reapply_desired``); ``reset_desired`` forgets it and goes back to
the file. ``reported`` says which version is in force in this run (``desired_version``) and why the
last one was not applied (``desired_error``).

Locking: ``_desired_lock`` (re-entrant) serialises the command worker, SIGHUP's reload and the
start's restore; a document that arrives before the agent can apply it is kept and retried by
``restore_desired``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..config.sla import sla_metric_problem
from .client import Incoming
from .command_args import describe
from .schema import Desired
from .signing import Malformed, Unsigned

if TYPE_CHECKING:
    from .command_args import CommandTarget
    from .ledger import Ledger
    from .signing import Verifier

log = logging.getLogger(__name__)

DESIRED_KEY = "desired_version"
DESIRED_DOC_KEY = "desired_document"  # the applied document itself, re-applied after a restart


class DesiredOverlay:
    """The ``desired`` overlay (see the module doc). The class that inherits it provides ``target``,
    ``ledger``, ``max_bytes``, ``verifier``, ``stats``, ``limited``, ``_dropped`` and
    ``publish_reported``, and calls ``_init_desired`` from its constructor.

    Guarantee: whatever arrives on ``desired`` is applied, or refused with the reason in
    ``desired_error`` (and ``reported``); no exception leaves ``_desired`` for a document it cannot read."""

    target: CommandTarget
    ledger: Ledger
    max_bytes: int
    verifier: Verifier
    stats: dict[str, int]
    limited: Callable[..., bool]
    _dropped: Callable[[str], None]
    publish_reported: Callable[[dict[str, Any]], None]

    def _init_desired(self) -> None:
        self.desired_error: str | None = None
        self.desired_in_force: int | None = None  # the desired version applied in this run
        self._desired_lock = threading.RLock()  # the worker, SIGHUP's reload and start's restore
        self._desired_retry: bytes | None = None  # a desired that could not apply before the agent served

    def _desired(self, msg: Incoming) -> None:
        """Check the signature (when required) before ``apply_desired`` sees the document."""
        if not msg.payload or len(msg.payload) > 2 * self.max_bytes:
            self.apply_desired(msg.payload)  # cleared retained message, or refused there as oversized
            return
        try:
            payload = self.verifier.open(msg.topic, msg.payload)
        except Unsigned as exc:  # the verifier raises nothing else, whatever the bytes
            self.stats["unsigned"] += 1
            if isinstance(exc, Malformed):
                self.stats["malformed"] += 1
                self._dropped("malformed_envelope")
            self._refuse_desired(f"desired not applied: {exc}")
            return
        if not payload:  # an envelope around nothing is not the broker clearing a retained message
            self._refuse_desired("desired not applied: the signed envelope holds an empty document")
            return
        self.apply_desired(payload)

    def _refuse_desired(self, reason: str) -> None:
        """Record the refusal for ``reported`` and log it, at most once per period (a flood of them
        on the retained topic must not flood the log)."""
        self.desired_error = reason
        self.limited(logging.ERROR, "desired", "%s", reason)
        self._report()

    def apply_desired(self, payload: bytes) -> bool:
        """Apply a retained ``desired`` document if newer than the stored one (or the same version not
        yet in force in this run), keep it in the ledger, echo in ``reported``. The same version again
        (the broker re-sends retained messages on every connection) changes nothing."""
        if not payload:  # a cleared retained message
            return False
        try:
            desired = Desired.model_validate_json(payload[: self.max_bytes + 1])
            if len(payload) > self.max_bytes:
                raise ValueError(f"desired is {len(payload)} bytes, over {self.max_bytes}")
        except (ValidationError, ValueError) as exc:
            reason = describe(exc) if isinstance(exc, ValidationError) else str(exc)
            self._refuse_desired(f"desired not applied: {reason}")
            return False
        with self._desired_lock:
            last = int(self.ledger.get(DESIRED_KEY) or -1)
            stored = self.ledger.get(DESIRED_DOC_KEY) is not None
            if desired.version < last or (desired.version == last and stored):
                if desired.version == last and self.desired_in_force is None:
                    # After a restart, before the agent serves: restore_desired applies the stored copy.
                    self._desired_retry = payload
                self._report()
                return False
            applied = self._apply(desired)
            if applied:
                self.ledger.put_many({DESIRED_DOC_KEY: desired.to_json().decode(), DESIRED_KEY: str(desired.version)})
            elif self.desired_error and " failed: " in self.desired_error:
                self._desired_retry = payload  # e.g. the controllers do not exist yet; retried at start
        self._report()
        return applied

    def _apply(self, desired: Desired) -> bool:
        """Check, then apply every SLA and pin of ``desired``; sets ``desired_error`` / ``desired_in_force``."""
        tiers = self.target.tiers()
        problems = [f"sla.{w}: unknown workload" for w in desired.sla if w not in tiers]
        problems += [
            f"sla.{w}.metric: {problem}"
            for w, sla in desired.sla.items()
            if w in tiers and (problem := sla_metric_problem(w, sla.metric)) is not None
        ]
        problems += [
            f"pins.{w}: tier {t!r} is not configured"
            for w, t in desired.pins.items()
            if w not in tiers or (t is not None and t not in tiers[w])
        ]
        if problems:
            self.desired_error = f"desired version {desired.version} not applied: {'; '.join(problems)}"
            log.error("%s", self.desired_error)
            return False
        source = f"desired@{desired.version}"
        try:
            for workload, sla in desired.sla.items():
                self.target.set_sla(workload, sla, source=source)
            for workload, tier in desired.pins.items():
                if tier is None:
                    self.target.unpin_tier(workload, source=source)
                else:
                    self.target.pin_tier(workload, tier, source=source)
        except Exception as exc:
            self.desired_error = f"desired version {desired.version} failed: {exc}"
            log.error("%s", self.desired_error)
            return False
        self.desired_in_force, self.desired_error = desired.version, None
        log.info("desired version %d in force", desired.version)
        return True

    def stored_desired(self) -> Desired | None:
        raw = self.ledger.get(DESIRED_DOC_KEY)
        if raw is None:
            last = self.ledger.get(DESIRED_KEY)
            if last is not None:  # a ledger from before documents were kept: the version alone is useless
                self.ledger.delete(DESIRED_KEY)
                log.warning(
                    "desired version %s was applied before, but its document was not kept; the "
                    "fleet's retained copy will be applied again",
                    last,
                )
            return None
        try:
            return Desired.model_validate_json(raw)
        except ValidationError as exc:
            self.desired_error = f"stored desired not re-applied: {describe(exc)}"
            log.error("%s", self.desired_error)
            return None

    def reapply_desired(self) -> bool:
        """Put the stored desired document back in force on top of the file (after a reload of the
        file, or at start); ``reported`` is the caller's to publish."""
        with self._desired_lock:
            desired = self.stored_desired()
            self.desired_in_force = None
            return desired is not None and self._apply(desired)

    def restore_desired(self) -> bool:
        """At start, once the agent can apply it: the stored desired first, then any newer one that
        arrived too early; then ``reported``."""
        with self._desired_lock:
            applied = self.reapply_desired()
            retry, self._desired_retry = self._desired_retry, None
        if retry is not None:
            return self.apply_desired(retry) or applied
        self._report()
        return applied

    def reset_desired(self) -> dict[str, Any]:
        """Forget the stored desired (version and document), so that the next desired of any version
        applies, and go back to the file (``target.reload``); for a signed ``reset_desired`` command."""
        with self._desired_lock:
            forgotten = self.desired_in_force
            if forgotten is None:
                last = self.ledger.get(DESIRED_KEY)
                forgotten = int(last) if last is not None else None
            self.ledger.delete(DESIRED_KEY, DESIRED_DOC_KEY)
            self.desired_in_force, self.desired_error, self._desired_retry = None, None, None
            message = self.target.reload()
        log.info("desired version %s forgotten: %s", forgotten, message)
        self._report()
        return {"forgotten_version": forgotten, "reload": message, "desired_version": None}

    def reported(self) -> dict[str, Any]:
        doc = dict(self.target.reported())
        doc["desired_version"] = self.desired_in_force
        doc["desired_error"] = self.desired_error
        return doc

    def _report(self) -> None:
        try:
            self.publish_reported(self.reported())
        except Exception:
            self.stats["errors"] += 1
            log.exception("publishing reported state failed")
