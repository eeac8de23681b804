"""Errors the agent raises, as one small tree.

Every message says what went wrong, naming the thing (a file, a key, a backend, a device), and
what to do about it. The CLI prints ``str(error)`` on one line and exits non-zero; library
callers catch ``EdgeAgentError``.

    EdgeAgentError
    ├── ConfigError             a config file or value is wrong (lists every problem)
    ├── ModelError              a model is unknown, incomplete or unreadable
    │   └── ModelNotFound       no demo model by that name and no such folder
    ├── BackendError            a runtime failed
    │   ├── BackendUnavailable  the runtime's Python package is not installed (names the extra)
    │   ├── DeviceUnavailable   the runtime is there, the device (GPU, NPU) is not
    │   └── EngineError         an engine/plan file is corrupt or was built for another runtime/device
    ├── InputError              a request's inputs are malformed (shapes, dtypes, names, prompt text)
    │   └── FieldError          one named request field cannot be honoured (HTTP 400)
    ├── Overloaded              the agent is at capacity; try again later (HTTP 429)
    │   └── Unavailable         shedding load or shutting down (HTTP 503)
    ├── DeadlineExceeded        a request waited past its queue timeout or deadline
    └── Interrupted             a running model call was stopped on purpose (preempted); its work is redone
"""

from __future__ import annotations


class EdgeAgentError(Exception):
    """Base of every error the agent reports to a user."""


class ConfigError(EdgeAgentError):
    """Configuration is invalid. ``problems`` holds ``(dotted.path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "; ".join(f"{path}: {msg}" for path, msg in problems)
        super().__init__(f"invalid configuration{where}: {lines}")


class ModelError(EdgeAgentError):
    """A model folder or file is missing, incomplete or unreadable."""


class ModelNotFound(ModelError):
    """No demo model has this name and no folder exists at this path."""


class BackendError(EdgeAgentError):
    """An inference runtime failed."""


class BackendUnavailable(BackendError):
    """The runtime's Python package is not importable here."""


class DeviceUnavailable(BackendError):
    """The runtime is installed but the requested device is not present."""


class EngineError(BackendError):
    """An engine file is corrupt, truncated, or built for another runtime version or device."""


class InputError(EdgeAgentError):
    """Inputs to a model or request are malformed; ``param`` names the request field when there is one."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FieldError(InputError):
    """A request field that cannot be honoured (HTTP 400); ``param`` names the field (it is required)."""

    def __init__(self, message: str, param: str) -> None:
        InputError.__init__(self, message)
        self.param = param


class Overloaded(EdgeAgentError):
    """The agent is at capacity; the request was not admitted (HTTP 429: retry shortly). ``retry_after_s``:
    when a request would be admitted again, where admission could tell; ``reason``: a short tag for metrics."""

    def __init__(self, message: str = "", retry_after_s: float | None = None, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class Unavailable(Overloaded):
    """The agent is not admitting requests now: shedding load or shutting down (HTTP 503)."""


class DeadlineExceeded(EdgeAgentError):
    """A request was not started within its queue timeout or its own deadline."""


class Interrupted(EdgeAgentError):
    """A running model call was stopped on purpose (``interrupt``: more urgent work preempted it); nothing is
    wrong, and the caller redoes the work when it is wanted again."""


def none_loaded(workload: str, errors: list[tuple[str, str]]) -> ModelError:
    """The error of a tier ladder none of whose tiers loaded, in one line, tiers that failed the same way
    named together: ``no LLM tier could be loaded: full, short: model 'x' is not here yet: get it …``."""
    by_error: dict[str, list[str]] = {}
    for tier, error in errors:
        by_error.setdefault(error, []).append(tier)
    return ModelError(
        f"no {workload} tier could be loaded: "
        + "; ".join(f"{', '.join(tiers)}: {error}" for error, tiers in by_error.items())
    )
