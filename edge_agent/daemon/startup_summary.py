"""What ``edge-agent run`` logs first: version, where its configuration came from, the device id and
its origin, the tiers and the runtimes that will serve them. One glance at ``journalctl -u
edge-agent`` then answers "which file, which device, which models" without reading the config.

Environment variables are listed by name only: ``EDGE_AGENT_MQTT__PASSWORD`` must not reach a log.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from ..config import ENV_PREFIX, Settings, read_toml, resolve_config_path
from ..errors import ConfigError
from .statelock import state_dirs


def config_sources(config: str | Path | None) -> tuple[Path | None, list[str]]:
    """(the TOML file read, or None for built-in defaults; the ``EDGE_AGENT_*`` variables set)."""
    path = resolve_config_path(config)
    return path, sorted(k for k in os.environ if k.startswith(ENV_PREFIX))


def device_id_origin(config: str | Path | None) -> str:
    """Where ``mqtt.device_id`` came from: the environment, the file, or the host name (the default)."""
    env = f"{ENV_PREFIX}MQTT__DEVICE_ID"
    if os.environ.get(env):
        return f"environment {env}"
    path = resolve_config_path(config)
    if path is not None:
        try:
            if "device_id" in (read_toml(path).get("mqtt") or {}):
                return f"{path} [mqtt] device_id"
        except ConfigError:
            pass
    return "the host name (set [mqtt] device_id to pin it)"


def _runtime(backend: str) -> str:
    from ..engines.fingerprint import runtime_version

    try:
        version = runtime_version(backend)
    except Exception:  # a broken runtime install must not stop the summary
        version = None
    return f"{backend} {version}" if version else f"{backend} (not installed)"


def startup_lines(settings: Settings, config: str | Path | None) -> list[str]:
    path, env = config_sources(config)
    source = str(path) if path else "built-in defaults (no config file)"
    lines = [
        f"edge-agent {__version__} starting (pid {os.getpid()})",
        f"config: {source}" + (f" + environment {', '.join(env)}" if env else ""),
        f"device id: {settings.mqtt.device_id} (from {device_id_origin(config)})",
    ]
    for workload in ("llm", "asr"):
        tiers = getattr(settings.models, workload)
        described = " > ".join(f"{t.name} ({t.model}, {t.backend}/{t.device}, {t.precision})" for t in tiers)
        lines.append(f"{workload} tiers: {described or '(none)'}")
    if settings.device.npu_emulation != "off":
        from ..backends.npu import describe

        lines.append(f"WARNING: {describe()}")
    backends = dict.fromkeys(t.backend for t in settings.models.llm + settings.models.asr)
    lines.append("backends: " + (", ".join(_runtime(b) for b in backends) or "(none)"))
    api = str(settings.api.unix_socket) if settings.api.unix_socket else f"{settings.api.host}:{settings.api.port}"
    lines.append(f"calibration capture: {settings.calibration.summary()}")
    lines.append(
        f"mqtt {settings.mqtt.host}:{settings.mqtt.port}; api {api}; state in "
        + ", ".join(str(d) for d in state_dirs(settings))
    )
    return lines
