"""Losses the spool has not reported yet, per reason, and the ``spool_drop`` reports made of them.

A report leaves this ledger only once its event is stored (``Spool.report_drops`` puts it back
otherwise), so a loss is never forgotten because the report of it could not be written either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .schema import SpoolDrop

MAX_RANGES = 32
MAX_DETAIL = 1024


@dataclass
class Loss:
    """What one reason lost since its last report."""

    windows: int = 0
    events: int = 0
    bytes: int = 0
    seqs: list[int] = field(default_factory=list)  # window seqs; a window lost before numbering has none
    detail: str | None = None

    def merge(self, other: Loss) -> None:
        self.windows += other.windows
        self.events += other.events
        self.bytes += other.bytes
        self.seqs.extend(other.seqs)
        self.detail = self.detail or other.detail

    def report(self, reason: str) -> SpoolDrop:
        return SpoolDrop(
            reason=reason,
            windows=self.windows,
            events=self.events,
            bytes=self.bytes,
            seq_ranges=ranges(self.seqs),
            detail=self.detail[:MAX_DETAIL] if self.detail else None,
        )

    def split(self) -> list[Loss]:
        """Parts of at most ``MAX_RANGES`` seq ranges each: a report stays small and exact (folding
        ranges together would name seqs that were never lost). Counts follow the seqs; what has no
        seq (events, bytes, unnumbered windows) stays with the first part."""
        rs = ranges(self.seqs)
        if len(rs) <= MAX_RANGES:
            return [self]
        parts = []
        for i in range(0, len(rs), MAX_RANGES):
            seqs = [v for lo, hi in rs[i : i + MAX_RANGES] for v in range(lo, hi + 1)]
            parts.append(Loss(windows=len(seqs), seqs=seqs, detail=self.detail))
        first = parts[0]
        first.windows += self.windows - len(set(self.seqs))
        first.events, first.bytes = self.events, self.bytes
        return parts


class Drops:
    """Unreported losses per reason, turned into ``spool_drop`` reports by ``take``."""

    def __init__(self) -> None:
        self.by_reason: dict[str, Loss] = {}

    def add(self, reason: str, kind: str, seq: int, size: int, detail: str | None = None) -> None:
        loss = self.by_reason.setdefault(reason, Loss())
        if kind == "window":
            loss.windows += 1
            if seq > 0:
                loss.seqs.append(seq)
        else:
            loss.events += 1
        loss.bytes += size
        if detail:
            loss.detail = detail

    def note(self, reason: str, detail: str) -> None:
        self.by_reason.setdefault(reason, Loss()).detail = detail

    def pop(self) -> list[tuple[str, Loss]]:
        taken, self.by_reason = self.by_reason, {}
        return sorted(taken.items())

    def restore(self, reason: str, loss: Loss) -> None:
        """Put back a report whose event was not stored (merged with anything lost since)."""
        newer = self.by_reason.get(reason)
        if newer is not None:
            loss.merge(newer)
        self.by_reason[reason] = loss

    def report(self, store: Callable[[SpoolDrop], bool]) -> int:
        """Hand every report to ``store``; from the first it could not store on, keep them all."""
        parts = [(reason, part) for reason, loss in self.pop() for part in loss.split()]
        for i, (reason, part) in enumerate(parts):
            if not store(part.report(reason)):
                for later_reason, later in parts[i:]:
                    self.restore(later_reason, later)
                return i
        return len(parts)

    def take(self) -> list[SpoolDrop]:
        return [part.report(reason) for reason, loss in self.pop() for part in loss.split()]


def ranges(values: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for v in sorted(set(values)):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return [(a, b) for a, b in out]
