"""A real, tiny ``CommandTarget``: in-memory tiers, SLA and pins, as the agent will keep them."""
from __future__ import annotations

import threading
from typing import Any

from edge_agent.errors import EdgeAgentError
from edge_agent.telemetry.schema import SlaSpec


class TinyAgent:
    def __init__(self, tiers: dict[str, list[str]] | None = None, recipes: tuple[str, ...] = ("phi3-int8",)) -> None:
        self._tiers = tiers or {"llm": ["small", "tiny"], "asr": ["ctc"]}
        self._recipes = recipes
        self.active = {w: names[0] for w, names in self._tiers.items()}
        self.pins: dict[str, str] = {}
        self.sla: dict[str, SlaSpec] = {}
        self.calls: list[tuple[str, Any]] = []
        self.flushes = 0
        self.fail_rebuild: str | None = None
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()

    def tiers(self) -> dict[str, list[str]]:
        return self._tiers

    def recipes(self) -> tuple[str, ...]:
        return self._recipes

    def status(self) -> dict[str, Any]:
        return {"active_tiers": dict(self.active), "pins": dict(self.pins)}

    def set_sla(self, workload: str, sla: SlaSpec) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("set_sla", workload))
            self.sla[workload] = sla
        return {"workload": workload, "sla": sla.model_dump()}

    def pin_tier(self, workload: str, tier: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("pin_tier", (workload, tier)))
            self.pins[workload] = tier
            self.active[workload] = tier
        return {"workload": workload, "tier": tier}

    def unpin_tier(self, workload: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("unpin_tier", workload))
            self.pins.pop(workload, None)
        return {"workload": workload}

    def rebuild_engine(self, recipe: str) -> dict[str, Any]:
        self.gate.wait(30)
        with self._lock:
            self.calls.append(("rebuild_engine", recipe))
        if self.fail_rebuild:
            raise EdgeAgentError(self.fail_rebuild)
        return {"recipe": recipe, "engine_hash": "sha256:abc"}

    def flush_telemetry(self) -> dict[str, Any]:
        self.flushes += 1
        return {"flushed": True}

    def reported(self) -> dict[str, Any]:
        return {"active_tiers": dict(self.active), "pins": dict(self.pins),
                "sla": {w: s for w, s in self.sla.items()}, "engine_hashes": {"small": "sha256:abc"}}
