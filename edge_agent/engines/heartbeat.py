"""A build's pulse: progress bars, systemd's patience (EXTEND_TIMEOUT_USEC) and the cancel flag.

Every build step and every stage takes one ``Heartbeat``; ``beat`` at each sample is where a
cancelled build stops (``BuildCancelled``) and where a long step keeps systemd from timing out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import EdgeAgentError
from ..progress import Progress
from ..systemd import Notifier


class BuildCancelled(EdgeAgentError):
    """The build was asked to stop (the agent is stopping); its finished steps stay staged."""


@dataclass(slots=True)
class Heartbeat:
    """Progress on stderr, and EXTEND_TIMEOUT_USEC to systemd while long steps run."""

    enabled: bool = True
    notifier: Notifier = field(default_factory=Notifier)
    extend_s: float = 120.0
    clock: Callable[[], float] = time.monotonic
    cancel: threading.Event | None = None  # set: the next beat() raises BuildCancelled
    _last_extend: float = float("-inf")

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise BuildCancelled("engine build cancelled")

    def beat(self) -> None:
        """A progress tick: raises ``BuildCancelled`` when cancelled, else keeps systemd patient."""
        self.check()
        self.pulse()

    def pulse(self) -> None:
        """Keep systemd patient without checking for cancellation (for callbacks from native code,
        where an exception must not cross back into C++)."""
        now = self.clock()
        if now - self._last_extend >= self.extend_s / 4:
            self.notifier.extend_timeout(self.extend_s)
            self._last_extend = now

    def bar(self, label: str, unit: str = "") -> Progress:
        return Progress(label, unit=unit, enabled=self.enabled)

    def callback(self, bar: Progress) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            self.beat()
            bar.update(done, total)

        return update
