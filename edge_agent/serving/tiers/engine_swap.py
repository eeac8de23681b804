"""Serving a freshly built engine: the LLM tier that serves now reloads onto it in place.

``TierEngines`` announces an engine that passed the gate (``on_engine_ready``); the app wires that
to ``swap_onto_engine``, so the engines never hold the ladder that serves them. The reload loads
and warms the engine aside and swaps it in between batches: no request fails. A tier loaded ahead
(beside the serving one) is loaded ahead again onto it; any other picks its engine up the next time it
is loaded (a controller switch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...engines.resolve import Resolved
    from ..llm.tiers import TieredLLM

Event = Callable[[str, dict], None]


def swap_onto_engine(
    ladder: TieredLLM | None, tier: str, serving: Callable[[str], Resolved | None], on_event: Event
) -> None:
    """Reload ``tier`` onto its new engine when it is the one serving; ``serving(tier)`` says what it
    serves afterwards (for the ``engine_swap`` event)."""
    if ladder is None:
        return
    if ladder.active_tier != tier:
        ladder.reload_ahead(tier)  # loaded ahead of a switch: again, onto the new engine
        return
    if not reload_in_place(ladder, ladder.active):
        return
    ladder.wait_switched()
    now = serving(tier)
    ok = ladder.active_tier == tier and now is not None and now.engine is not None
    on_event(
        "engine_swap", {"workload": "llm", "tier": tier, "ok": ok, "serving": now.identity if now is not None else None}
    )


def reload_in_place(served: TieredLLM, index: int, wait_s: float = 120.0) -> bool:
    """Reload the serving tier ``index`` (now resolving to its engine), waiting out a switch already
    in progress; False when ``index`` is not the active tier (it picks its engine up when next loaded)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if served.active_tier is None or served.active != index:
            return False
        if served.switch_to(index, reload=True):
            return True
        served.wait_switched(1.0)
    return False
