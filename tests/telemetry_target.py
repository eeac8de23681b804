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
        self.sources: dict[str, str] = {}  # "sla.llm" / "pins.llm" -> "command" | "desired@<v>" | "file"
        self.reloads = 0
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

    def set_sla(self, workload: str, sla: SlaSpec, source: str = "command") -> dict[str, Any]:
        with self._lock:
            self.calls.append(("set_sla", workload))
            self.sla[workload] = sla
            self.sources[f"sla.{workload}"] = source
        return {"workload": workload, "sla": sla.model_dump()}

    def pin_tier(self, workload: str, tier: str, source: str = "command") -> dict[str, Any]:
        with self._lock:
            self.calls.append(("pin_tier", (workload, tier)))
            self.pins[workload] = tier
            self.active[workload] = tier
            self.sources[f"pins.{workload}"] = source
        return {"workload": workload, "tier": tier}

    def unpin_tier(self, workload: str, source: str = "command") -> dict[str, Any]:
        with self._lock:
            self.calls.append(("unpin_tier", workload))
            self.pins.pop(workload, None)
            self.sources[f"pins.{workload}"] = source

    def reload(self) -> str:
        """Back to the "file": no SLA override, and no pin that a desired set."""
        with self._lock:
            self.reloads += 1
            self.sla.clear()
            for key in [k for k, v in self.sources.items() if v.startswith("desired@") or k.startswith("sla.")]:
                self.sources[key] = "file"
                if key.startswith("pins."):
                    self.pins.pop(key[5:], None)
        return "reloaded"

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
        return {
            "active_tiers": dict(self.active),
            "pins": dict(self.pins),
            "sla": {w: s for w, s in self.sla.items()},
            "sources": dict(self.sources),
            "engine_hashes": {"small": "sha256:abc"},
        }
