"""What every tier ladder shares (``llm.tiers.TieredLLM``, ``asr.tiers.TieredSpeech``): the active tier,
the start on the first tier that loads, and one background switch at a time.

A subclass keeps ``self._active`` (an object with ``.index`` and ``.tier``) and implements
``_load(index)`` (load and warm a tier) and ``_retire(old)`` (drain and free the tier swapped out).
``start_first`` serves from the top tier, or else the first lighter one that loads.
``switch_to`` runs the switch on a thread of its own and refuses while one is still running, its
retirement included, so at most two tiers are ever in memory. ``on_switched(old, new, load_ms,
error)`` is told when a switch completes or fails; a tier that cannot load leaves the current one
serving.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import EdgeAgentError

log = logging.getLogger(__name__)
Switched = Callable[[int, int, float, "str | None"], None]  # (old, new, load_ms, error)


class Ladder(ABC):
    """Tiers heaviest first, one of them active (see the module doc)."""

    kind = "tier"  # for messages and thread names: "tier", "ASR tier"
    workload = "llm"  # as the logs name it

    def __init__(self, tiers: Sequence[Any], on_switched: Switched | None = None) -> None:
        if not tiers:
            raise ValueError(f"at least one {self.kind} is needed")
        self.tiers = list(tiers)
        self._on_switched = on_switched or (lambda old, new, ms, err: None)
        self._lock = threading.Lock()
        self._active: Any = None
        self._switching: threading.Thread | None = None
        # Set by the tier controller: reject new work (503), and cap the tokens of new requests (LLM).
        self.shedding = False
        self.token_cap_ratio = 1.0

    def start(self, tier: int = 0) -> Ladder:
        """Load and serve tier ``tier`` now (on the caller's thread)."""
        self._active = self._load(tier)
        return self

    def start_first(self, on_load_failed: Callable[[str, EdgeAgentError], None] | None = None) -> list[tuple[str, str]]:
        """Serve from the top tier, or the first lighter one that loads. Returns ``(tier, error)`` for
        each tier that could not load (every tier: nothing serves, ``_active`` stays None);
        ``on_load_failed(tier, error)`` is told of each."""
        errors: list[tuple[str, str]] = []
        for index, tier in enumerate(self.tiers):
            try:
                self.start(index)
                return errors
            except EdgeAgentError as exc:
                errors.append((tier.name, str(exc)))
                log.error("%s tier %r could not load (%s); trying the next one", self.workload.upper(), tier.name, exc)
                if on_load_failed is not None:
                    on_load_failed(tier.name, exc)
        return errors

    @property
    def active(self) -> int:
        assert self._active is not None, "start() first"
        return self._active.index

    @property
    def active_tier(self) -> str | None:
        loaded = self._active
        return loaded.tier.name if loaded is not None else None

    @property
    def switching(self) -> bool:
        """A switch is loading (or, where the subclass waits for it, its old tier still draining)."""
        return self._switching is not None and self._switching.is_alive()

    def switch_to(self, index: int, reload: bool = False) -> bool:
        """Start moving to tier ``index`` in the background; False when already there or busy switching.

        ``reload``: load the *active* tier again (its opener now finds a newly built engine) through
        the same machinery: loaded and warmed aside, swapped in, the old copy retired."""
        if not 0 <= index < len(self.tiers):
            raise ValueError(f"no {self.kind} {index} (the ladder has {len(self.tiers)})")
        with self._lock:
            if self._active is None or (index == self._active.index) != reload or self.switching:
                return False
            name = f"{self.kind.replace(' ', '-').lower()}-load-{index}"
            self._switching = threading.Thread(target=self._switch, args=(index,), name=name, daemon=True)
            self._switching.start()
        return True

    def wait_switched(self, timeout_s: float | None = None) -> None:
        thread = self._switching
        if thread is not None:
            thread.join(timeout_s)

    @abstractmethod
    def _load(self, index: int) -> Any:
        """Load and warm tier ``index``; what ``self._active`` holds."""

    @abstractmethod
    def _retire(self, old: Any) -> None:
        """Drain and free the tier just swapped out (on the switch thread)."""

    def _swapped(self, old: Any) -> None:  # noqa: B027 - an optional hook, not an abstract step
        """Under the lock, right after the swap (a subclass may note the tier it is draining)."""

    def relieve(self, shedding: bool, token_cap_ratio: float | None = None) -> None:
        """The controller's relief for new work: reject it (``shedding``: 503), and cap the tokens of new
        requests (``token_cap_ratio`` of each tier's ``max_new_tokens``; None leaves the cap as it is)."""
        self.shedding = shedding
        if token_cap_ratio is not None:
            self.token_cap_ratio = token_cap_ratio

    def set_max_batch(self, max_batch: int) -> None:  # noqa: B027 - a ladder whose batch is fixed ignores it
        """Adaptive batching (``Policy.adaptive_batch``): resize the active tier's batch."""

    def _switch(self, index: int) -> None:
        old = self._active
        assert old is not None
        start = time.perf_counter()
        try:
            new = self._load(index)
        except Exception as exc:  # a tier that cannot load must not take serving down
            log.error("could not load %s %r: %s", self.kind, self.tiers[index].name, exc)
            self._on_switched(
                old.index,
                index,
                (time.perf_counter() - start) * 1e3,
                str(exc) if isinstance(exc, EdgeAgentError) else f"{type(exc).__name__}: {exc}",
            )
            return
        load_ms = (time.perf_counter() - start) * 1e3
        with self._lock:
            self._active = new
            self._swapped(old)
        log.info("%s %r -> %r (loaded and warmed in %.0f ms)", self.kind, old.tier.name, new.tier.name, load_ms)
        self._on_switched(old.index, index, load_ms, None)
        self._retire(old)
