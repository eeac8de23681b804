"""One finished unit of work, as every consumer of latency sees it, and the seam that fans it out.

A ladder (``serving.llm.tiers.TieredLLM`` per request, ``serving.asr.tiers.TieredSpeech`` per
utterance) builds one ``Observation`` when the work ends and hands it to ``Observers.deliver``.
The agent registers the consumers once, at composition:

    observers = Observers()
    observers.register(metrics.observe)        # Prometheus /metrics
    observers.register(controller.observe)     # the tier controller's SLA window
    observers.register(telemetry.observe)      # the MQTT telemetry window

The record says which workload, tier and model served it (no string tags to parse), its samples
per metric (milliseconds; ``rtf`` is a ratio), and whether it is the first after a model load or a
warm-up: such a sample stays out of SLA windows and fleet histograms (it measures loading, not
serving); Prometheus counts every request but a warm-up (a voice turn's prefill ahead is no client's
request). A request served beside a one-sequence tier says which tier it spilled from
(``spilled_from``): that tier's controller counts it as its own. ``deliver`` runs on the device thread that
finished the work: an observer must not block (a lock and a few counters), and one that raises is
logged without stopping the others or the serving thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from .metrics.timing import RequestTiming
from .metrics.window import FIRST_AFTER_LOAD, SLA_EXCLUDED_TAGS, WARMUP

log = logging.getLogger(__name__)

Workload = Literal["llm", "asr"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One finished LLM request or ASR utterance (see the module doc)."""

    workload: Workload
    tier: str
    model: str
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # metric -> values, none empty
    engine: str | None = None  # the serving engine's identity when known (``engine:<key>``, ``model:<sha>``)
    first_after_load: bool = False  # or a warm-up: out of SLA windows and fleet histograms
    tokens_in: int = 0
    tokens_out: int = 0
    warmup: bool = False  # a warm-up (``WARMUP`` tag): out of /metrics as well
    spilled_from: str | None = None  # served by the spill tier of this tier (``serving.llm.tiers``)

    @classmethod
    def of_request(cls, timing: RequestTiming, tier: str, model: str, engine: str | None = None) -> Observation:
        """An LLM request's timeline (``metrics.timing``) as an observation."""
        return cls(
            "llm",
            tier,
            model,
            {m: v for m, v in timing.samples().items() if v},
            engine,
            not SLA_EXCLUDED_TAGS.isdisjoint(timing.tags),
            timing.tokens_in,
            timing.tokens_out,
            WARMUP in timing.tags,
        )

    @property
    def tags(self) -> tuple[str, ...]:
        """The exclusion tags ``metrics.window.RollingWindow`` understands."""
        return (FIRST_AFTER_LOAD,) if self.first_after_load else ()


Observer = Callable[[Observation], None]


class Observers:
    """The fan-out seam: ``register`` consumers once, ``deliver`` each observation to all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[Observer, ...] = ()

    def register(self, observer: Observer) -> Observer:
        with self._lock:
            self._observers = (*self._observers, observer)
        return observer

    def deliver(self, obs: Observation) -> None:
        for observer in self._observers:  # a tuple swapped whole under the lock: no lock on the hot path
            try:
                observer(obs)
            except Exception:  # a consumer must never break serving, nor starve the others
                log.exception("%s observer %r failed", obs.workload, observer)
