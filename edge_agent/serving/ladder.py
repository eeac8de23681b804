"""What every tier ladder shares (``TieredLLM``, ``serving.speech.Speech``): the active tier, and one
background switch at a time.

A subclass keeps ``self._active`` (an object with ``.index``) and implements ``_switch(index)``,
which loads and warms the tier, swaps it in and retires the old one; ``switch_to`` starts it on a
thread of its own and refuses while one is still running, so at most two tiers are ever in memory.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence


class Ladder:
    kind = "tier"  # for messages and thread names: "tier", "ASR tier"

    def __init__(self, tiers: Sequence[Any]) -> None:
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = list(tiers)
        self._lock = threading.Lock()
        self._active: Any = None
        self._switching: threading.Thread | None = None

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

    def _switch(self, index: int) -> None:
        raise NotImplementedError
