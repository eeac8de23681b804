"""Agent configuration: a TOML file, then ``EDGE_AGENT_…`` environment variables on top.

Sources, lowest to highest priority:
1. built-in defaults (the embedded default: ONNX Runtime on the CPU, Gemma 3 270M LLM tiers, the Whisper
   base speech tier, local broker);
2. the TOML file: ``--config FILE`` (must exist), else ``/etc/edge-agent/agent.toml`` if present;
3. environment: ``EDGE_AGENT_MQTT__PORT=1883`` (``__`` separates nested keys; lists as JSON).

Every problem is reported as ``dotted.path: message`` (``ConfigError.problems``). Unknown keys
are errors, so a typo never silently falls back to a default. Each component receives only its
own section.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import ConfigError
from .api import ApiConfig
from .asr import AsrConfig
from .base import INTERNAL_BACKENDS, Backend, DeviceConfig, Precision, Section, default_cache_dir
from .mqtt import FLEET_COMMANDS, FleetCommand, MqttConfig, TelemetryConfig, TlsConfig
from .prefix_cache import PrefixCacheConfig
from .problems import validation_problems
from .runtime import AudioConfig, CalibrationConfig, EnginesConfig, LoggingConfig
from .settings import ENV_PREFIX, Settings
from .sla import ASR_SLA_METRICS, SLA_PRESETS, AsrSlaConfig, AsrSlaMetric, SlaConfig, SlaPreset
from .tiers import AsrTierConfig, BatchingConfig, LLMTierConfig, ModelsConfig, TierConfig
from .wyoming import WyomingConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ASR_SLA_METRICS",
    "DEFAULT_CONFIG",
    "ENV_PREFIX",
    "FLEET_COMMANDS",
    "INTERNAL_BACKENDS",
    "SLA_PRESETS",
    "ApiConfig",
    "AsrConfig",
    "AsrSlaConfig",
    "AsrSlaMetric",
    "AsrTierConfig",
    "AudioConfig",
    "Backend",
    "BatchingConfig",
    "CalibrationConfig",
    "DeviceConfig",
    "EnginesConfig",
    "FleetCommand",
    "LLMTierConfig",
    "LoggingConfig",
    "ModelsConfig",
    "MqttConfig",
    "Precision",
    "PrefixCacheConfig",
    "Section",
    "Settings",
    "SlaConfig",
    "SlaPreset",
    "TelemetryConfig",
    "TierConfig",
    "TlsConfig",
    "WyomingConfig",
    "default_cache_dir",
    "load_settings",
    "read_toml",
    "resolve_config_path",
    "validation_problems",
]

# Read at call time by resolve_config_path, here in the package: tests and tools replace it on this module.
DEFAULT_CONFIG = Path("/etc/edge-agent/agent.toml")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([(str(path), f"not valid TOML: {exc}")]) from exc
    except OSError as exc:
        raise ConfigError([(str(path), f"cannot read: {exc.strerror}")]) from exc


def resolve_config_path(explicit: str | Path | None) -> Path | None:
    """The file to read: the explicit one (must exist), else the system default if present."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError([(str(path), "config file not found")])
        return path
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def load_settings(config: str | Path | None = None) -> Settings:
    """Load settings from ``config`` (or the default file) and the environment.

    Raises ``ConfigError`` listing every problem as ``dotted.path: message``.
    """
    path = resolve_config_path(config)
    data = read_toml(path) if path else {}
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc), str(path) if path else "environment") from exc
    if settings.device.npu_emulation != "off":
        # The NPU's emulation is process-wide, and child processes (probes, builds) must see the same NPU:
        # it travels in the variable the settings read it from (backends/npu.py).
        os.environ["EDGE_AGENT_DEVICE__NPU_EMULATION"] = settings.device.npu_emulation
    return settings
