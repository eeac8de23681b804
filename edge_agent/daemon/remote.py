"""The fleet's view of a running agent: the telemetry ``CommandTarget`` seam.

``RemoteTarget`` answers what the fleet asks (``tiers``, ``recipes``, ``status``, ``reported``,
``engine_hashes``) and applies what it sets (``set_sla``, ``pin_tier``, ``unpin_tier``,
``rebuild_engine``, ``flush_telemetry``, ``reload``) on the parts the ``Agent`` composed: its
tier controllers, ladders, engines and telemetry. It holds no state of its own, so a part that
is not running (no ASR configured, telemetry off) is simply absent from the answers.

Sources: every SLA and pin carries who set it (``file``, ``command``, ``desired@<version>``),
reported under ``sources``; a fleet SLA overlays the file's metric, percentile, target and
sample count, never its hysteresis (``serving.tiers.policy.overlay``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..config.sla import sla_metric_problem
from ..errors import EdgeAgentError
from ..serving.tiers.policy import overlay

if TYPE_CHECKING:
    from ..config import Settings
    from ..engines.background import TierEngines
    from ..serving.llm.tiers import TieredLLM
    from ..serving.tiers.control import TierController
    from ..telemetry.service import Telemetry


class Steerable(Protocol):
    """The parts of a running agent the fleet reads and steers (``Agent`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def llm(self) -> TieredLLM | None: ...

    @property
    def asr(self) -> Any: ...  # the speech ladder (``open_streams``, ``active_tier``), when ASR is configured

    @property
    def controller(self) -> TierController | None: ...

    @property
    def asr_controller(self) -> TierController | None: ...

    @property
    def telemetry(self) -> Telemetry | None: ...

    def health(self) -> dict[str, Any]: ...

    def reload(self) -> str: ...

    def tier_engines(self) -> TierEngines: ...


class RemoteTarget:
    """What the fleet may read and steer on a running agent's parts (see the module doc)."""

    def __init__(self, agent: Steerable) -> None:
        self.agent = agent

    def tiers(self) -> dict[str, list[str]]:
        models = self.agent.settings.models
        return {w: [t.name for t in getattr(models, w)] for w in ("llm", "asr") if getattr(models, w)}

    def recipes(self) -> list[str]:
        return self.agent.tier_engines().recipes(self.agent.settings.models.llm)

    def status(self) -> dict[str, Any]:
        a = self.agent
        out = {**a.health(), **self.reported()}
        if a.llm is not None:
            waiting, running = a.llm.load
            out["llm_load"] = {"waiting": waiting, "running": running}
        if a.controller is not None and a.controller.last is not None:
            out["llm_controller"] = {"action": a.controller.last.action, "reason": a.controller.last.reason}
        if a.asr is not None:
            out["asr_streams"] = a.asr.open_streams
        if a.asr_controller is not None and a.asr_controller.last is not None:
            out["asr_controller"] = {"action": a.asr_controller.last.action, "reason": a.asr_controller.last.reason}
        return out

    def _controller(self, workload: str) -> TierController | None:
        return {"llm": self.agent.controller, "asr": self.agent.asr_controller}.get(workload)

    def set_sla(self, workload: str, sla, source: str = "command") -> dict[str, Any]:
        """A fleet SLA (command or desired) on top of the file's; a changed target lifts truncation and
        shedding. The caller publishes ``reported`` (a desired applies several values at once)."""
        controller = self._controller(workload)
        if controller is None:
            raise EdgeAgentError(f"no SLA controller for workload {workload!r} on this device")
        problem = sla_metric_problem(workload, sla.metric)  # the command path checks first; this guards any caller
        if problem is not None:
            raise EdgeAgentError(problem)
        controller.set_policy(overlay(controller.policy, sla), sla.window_s, source=source)
        return {"sla": sla.model_dump()}

    def pin_tier(self, workload: str, tier: str, source: str = "command") -> dict[str, Any]:
        controller = self._controller(workload)
        if controller is None:
            raise EdgeAgentError(f"no tier controller for workload {workload!r} on this device")
        controller.pin(tier, source=source)
        self.publish_reported()
        return {"pinned": tier}

    def unpin_tier(self, workload: str, source: str = "command") -> dict[str, Any]:
        """Control goes back to the controller; an idle ladder returns to its top tier (``decide``)."""
        controller = self._controller(workload)
        if controller is not None:
            controller.unpin(source=source)
            self.publish_reported()
        return {"pinned": None}

    def reload(self) -> str:
        """Re-read the config file (``Agent.reload``), the stored desired on top."""
        return self.agent.reload()

    def rebuild_engine(self, recipe: str) -> dict[str, Any]:
        """Queue a forced background build of ``recipe``; returns at once (``engine_build`` events follow)."""
        return self.agent.tier_engines().rebuild(recipe, self.agent.settings.models.llm)

    def engine_hashes(self) -> dict[str, str]:
        """Per LLM tier loaded so far: ``engine:<cache key>`` or ``model:<sha256 of the folder>``."""
        return self.agent.tier_engines().identities()

    def flush_telemetry(self) -> dict[str, Any]:
        if self.agent.telemetry is not None:
            self.agent.telemetry.publisher.flush()
        return {"flushed": True}

    def reported(self) -> dict[str, Any]:
        a = self.agent
        out: dict[str, Any] = {
            "active_tiers": {},
            "pins": {},
            "sla": {},
            "sources": {},
            "engine_hashes": self.engine_hashes(),
        }
        if a.llm is not None and a.llm.active_tier is not None:
            out["active_tiers"]["llm"] = a.llm.active_tier
        if a.asr is not None and a.asr.active_tier is not None:
            out["active_tiers"]["asr"] = a.asr.active_tier
        for workload, controller in (("llm", a.controller), ("asr", a.asr_controller)):
            if controller is None:
                continue
            p = controller.policy
            if controller.state.pinned is not None:
                out["pins"][workload] = controller.served.tiers[controller.state.pinned].name
            out["sla"][workload] = {
                "metric": p.metric,
                "percentile": p.percentile,
                "target_ms": p.target_ms,
                "window_s": controller.window_s,
                "min_samples": p.min_samples,
            }
            out["sources"][f"sla.{workload}"] = controller.sla_source
            out["sources"][f"pins.{workload}"] = controller.pin_source
        return out

    def publish_reported(self) -> None:
        """The retained ``reported`` state, after anything it shows changed (tiers, pins, SLA)."""
        telemetry = self.agent.telemetry
        if telemetry is None or telemetry.commands is None:
            return
        commands = telemetry.commands
        commands.publish_reported(commands.reported())
