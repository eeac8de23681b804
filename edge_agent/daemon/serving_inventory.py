"""What the device serves, as the inventory in ``meta``: the engine (or model folder) behind each loaded
tier, republished after a switch or a fresh engine, and the accelerator probes' findings after start.

``InventoryFeed`` reads the running ``Agent``'s parts and hands ``telemetry`` the result; it never
disturbs serving (a failure is logged and the inventory stays as it was).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..telemetry.inventory import from_doctor

if TYPE_CHECKING:
    from ..config import Settings
    from ..engines.resolve import Resolved
    from ..serving.llm.tiers import TieredLLM
    from ..telemetry.service import Telemetry


class Inventoried(Protocol):
    """The parts of a running agent its inventory describes (``Agent`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def llm(self) -> TieredLLM | None: ...

    @property
    def asr(self) -> Any: ...  # the speech ladder (``tiers``, ``active_tier``), when ASR is configured

    @property
    def telemetry(self) -> Telemetry | None: ...

    @property
    def stopping(self) -> bool: ...

    def served_engines(self) -> dict[str, Resolved]: ...


log = logging.getLogger(__name__)


class InventoryFeed:
    """The agent's serving inventory for ``meta``: built from its tiers and engines, published on change."""

    def __init__(self, agent: Inventoried) -> None:
        self.agent = agent

    def engine_identity(self, tier: str) -> str | None:
        resolved = self.agent.served_engines().get(tier)
        return resolved.identity if resolved is not None else None

    def serving(self) -> list[dict[str, Any]]:
        """Per configured tier that has loaded: the engine (or model folder) it serves and how it was built."""
        agent = self.agent
        out: list[dict[str, Any]] = []
        served = agent.served_engines()
        active = agent.llm.active_tier if agent.llm is not None else None
        for t in agent.settings.models.llm:
            resolved = served.get(t.name)
            if resolved is None:
                continue
            doc: dict[str, Any] = {
                "workload": "llm",
                "tier": t.name,
                "model": t.model,
                "identity": resolved.identity,
                "backend": t.backend,
                "device": t.device,
                "precision": t.precision,
                "loaded": t.name == active,
            }
            if resolved.engine is not None:
                m = resolved.engine.manifest
                gate = m.get("accuracy") or {}
                doc.update(
                    key=resolved.engine.key,
                    backend=m.get("backend", t.backend),
                    device=m.get("device", t.device),
                    precision=m.get("precision", t.precision),
                    built_at_wall=m.get("committed_at"),
                    build_s=m.get("build_s"),
                    gate={k: gate[k] for k in ("passed", "metrics", "reasons") if k in gate} or None,
                )
            out.append(doc)
        asr_active = agent.asr.active_tier if agent.asr is not None else None
        asr_tiers: dict[str, Any] = {t.name: t for t in agent.asr.tiers} if agent.asr is not None else {}
        for a in agent.settings.models.asr:
            speech_tier = asr_tiers.get(a.name)
            if a.name == asr_active and speech_tier is not None:
                identity = speech_tier.engine() if speech_tier.engine is not None else None
                out.append(
                    {
                        "workload": "asr",
                        "tier": a.name,
                        "model": a.model,
                        "identity": identity,
                        "backend": a.backend,
                        "device": a.device,
                        "precision": a.precision,
                        "loaded": True,
                    }
                )
        return out

    def changed(self) -> None:
        agent = self.agent
        if agent.telemetry is not None:
            try:
                agent.telemetry.update_inventory(serving=self.serving())
            except Exception:  # the inventory describes serving; it must never disturb it
                log.warning("the inventory could not be updated", exc_info=True)

    def probe(self) -> None:
        from ..diagnostics.doctor import collect

        agent = self.agent
        try:
            report = collect(timeout_s=30)
        except Exception:
            log.warning("the accelerator probes failed; meta keeps the host inventory only", exc_info=True)
            return
        if agent.telemetry is not None and not agent.stopping:
            try:
                agent.telemetry.update_inventory(probes=from_doctor(report), serving=self.serving())
            except Exception:  # the inventory describes the device; it must never disturb it
                log.warning("the accelerator probes' findings could not be published", exc_info=True)
