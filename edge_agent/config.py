"""Agent configuration: a TOML file, then ``EDGE_AGENT_…`` environment variables on top.

Sources, lowest to highest priority:
1. built-in defaults (the embedded default: ONNX Runtime on the CPU, demo tiers, local broker);
2. the TOML file: ``--config FILE`` (must exist), else ``/etc/edge-agent/agent.toml`` if present;
3. environment: ``EDGE_AGENT_MQTT__PORT=1883`` (``__`` separates nested keys; lists as JSON).

Every problem is reported as ``dotted.path: message`` (``ConfigError.problems``). Unknown keys
are errors, so a typo never silently falls back to a default. Each component receives only its
own section.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import ConfigError, EdgeAgentError
from .fleet_keys import load_public_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = Path("/etc/edge-agent/agent.toml")
ENV_PREFIX = "EDGE_AGENT_"

Backend = Literal["onnxruntime", "openvino", "tensorrt", "fake"]
INTERNAL_BACKENDS = ("fake",)  # accepted (tests, benchmarks), never offered in a message to users
Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]


def _user_dir(kind: Literal["cache", "state"]) -> Path:
    # Under systemd, CacheDirectory=/StateDirectory= export these; they win over the user's dirs.
    env = os.environ.get("CACHE_DIRECTORY" if kind == "cache" else "STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    import platformdirs

    getter = platformdirs.user_cache_dir if kind == "cache" else platformdirs.user_state_dir
    return Path(getter("edge-agent"))


def default_cache_dir() -> Path:
    return _user_dir("cache")


class Section(BaseModel):
    """A configuration section: unknown keys are errors and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DeviceConfig(Section):
    """``[device]``: the target platform and the runtime's intra-op threads."""

    target: Literal["auto", "cpu", "jetson", "intel-npu"] = "auto"
    threads: int = Field(0, ge=0, description="intra-op threads per session; 0 = the runtime's default")


class TierConfig(Section):
    """One tier of ``[[models.llm]]`` or ``[[models.asr]]``: the model, backend, device and precision it runs with."""

    name: str = Field(min_length=1)
    model: str = Field(min_length=1, description="demo model name or a model folder")
    backend: Backend = "onnxruntime"
    device: str = "cpu"
    precision: Precision = "auto"
    max_new_tokens: int = Field(256, ge=1, le=32768)
    max_batch: int = Field(4, ge=1, le=128)


def _default_llm_tiers() -> list[TierConfig]:
    return [TierConfig(name="small", model="demo-phi3-small"), TierConfig(name="tiny", model="demo-phi3")]


def _default_asr_tiers() -> list[TierConfig]:
    return [TierConfig(name="ctc", model="demo-asr")]


class ModelsConfig(Section):
    """``[models]``: the LLM and ASR tiers, heaviest first, and the cache of generated demo weights."""

    llm: list[TierConfig] = Field(default_factory=_default_llm_tiers, description="heaviest tier first")
    asr: list[TierConfig] = Field(default_factory=_default_asr_tiers, description="heaviest tier first")
    cache_dir: Path = Field(default_factory=lambda: default_cache_dir() / "models")

    @field_validator("llm", "asr")
    @classmethod
    def _unique_names(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        names = [t.name for t in tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique; repeated: {dupes}")
        return tiers


class BatchingConfig(Section):
    """``[batching]``: dynamic batching and the admission queue's bounds."""

    max_batch: int = Field(4, ge=1, le=128)
    batch_timeout_ms: float = Field(80.0, ge=0, le=10_000)
    preferred_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4])
    max_queue: int = Field(64, ge=1)
    queue_timeout_ms: float = Field(30_000.0, gt=0)

    @model_validator(mode="after")
    def _preferred_within_max(self) -> BatchingConfig:
        bad = [b for b in self.preferred_batch_sizes if not 1 <= b <= self.max_batch]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} must lie within 1..max_batch ({self.max_batch})")
        return self


# Scenario SLAs (P95 unless noted): the abandonment cliff is the default.
SlaPreset = Literal[
    "default",
    "chit-chat",
    "customer-service",
    "medical-consultation",
    "live-risk-control",
    "video-conferencing",
    "asr-customer-service",
]
SLA_PRESETS: dict[SlaPreset, dict[str, Any]] = {
    "default": {"metric": "ttft_ms", "percentile": 95, "target_ms": 387.0},
    "chit-chat": {"metric": "ttft_ms", "percentile": 95, "target_ms": 350.0},
    "customer-service": {"metric": "ttft_ms", "percentile": 95, "target_ms": 220.0},
    "medical-consultation": {"metric": "ttft_ms", "percentile": 95, "target_ms": 150.0},
    "live-risk-control": {"metric": "ttft_ms", "percentile": 99, "target_ms": 85.0},
    "video-conferencing": {"metric": "ttft_ms", "percentile": 99, "target_ms": 150.0},
    "asr-customer-service": {"metric": "first_partial_ms", "percentile": 95, "target_ms": 300.0},
}


AsrSlaMetric = Literal["first_partial_ms", "final_ms"]
ASR_SLA_METRICS: tuple[str, ...] = typing.get_args(AsrSlaMetric)


class _SlaPolicy(Section):
    """What every workload's SLA policy has: the metric's percentile against a target over a rolling
    window, and the tier controller's hysteresis, cooldown, dwell and shedding
    (``serving.tier_policy.decide``)."""

    preset: SlaPreset | None = None
    percentile: float = Field(95, gt=0, le=100)
    window_s: float = Field(30.0, gt=0)
    min_samples: int = Field(20, ge=1)
    evaluate_every_s: float = Field(10.0, gt=0)
    downgrade_after: int = Field(3, ge=1, description="consecutive evaluations over target before a downgrade")
    upgrade_after: int = Field(6, ge=1, description="consecutive evaluations under upgrade_ratio × target")
    upgrade_ratio: float = Field(0.7, gt=0, lt=1)
    cooldown_s: float = Field(60.0, ge=0, description="since the last switch, before an upgrade")
    min_dwell_s: float = Field(30.0, ge=0, description="in a tier before any switch")
    shed_after: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _apply_preset(self) -> _SlaPolicy:
        if self.preset:
            for key, value in SLA_PRESETS[self.preset].items():
                if key not in self.model_fields_set:
                    object.__setattr__(self, key, value)
        return self


class AsrSlaConfig(_SlaPolicy):
    """``[sla.asr]``: the ASR tier ladder's policy (AI customer-service ASR: first partial ≤ 300 ms, P95).
    No token cap and no adaptive batch here: at the lightest tier, over target goes straight to the
    shedding count."""

    metric: AsrSlaMetric = "first_partial_ms"
    target_ms: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _asr_metric(self) -> AsrSlaConfig:
        # A preset's metric bypasses field validation: an LLM preset here would watch a metric ASR never has.
        if self.metric not in ASR_SLA_METRICS:
            asr = [n for n, p in SLA_PRESETS.items() if p["metric"] in ASR_SLA_METRICS]
            raise ValueError(
                f"preset {self.preset!r} sets metric {self.metric!r}, not an ASR metric "
                f"({', '.join(ASR_SLA_METRICS)}); ASR presets: {', '.join(asr)}"
            )
        return self


class SlaConfig(_SlaPolicy):
    """``[sla]``: the LLM policy (flat keys, as before), and ``[sla.asr]`` for the ASR ladder."""

    metric: Literal["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "first_partial_ms", "final_ms", "turn_ms"] = "ttft_ms"
    target_ms: float = Field(387.0, gt=0)
    adaptive_batch: Literal["auto", "on", "off"] = "auto"
    min_batch: int = Field(1, ge=1)
    min_token_cap_ratio: float = Field(0.25, gt=0, le=1)
    max_temp_c: float | None = Field(None, gt=0, le=150, description="opt-in: a lighter tier at this temperature")
    asr: AsrSlaConfig = Field(default_factory=AsrSlaConfig)


class TlsConfig(Section):
    """``[mqtt.tls]``: the CA to trust and, for mutual TLS, the client certificate and key."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _cert_needs_key(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mutual TLS needs both)")
        return self


def _default_device_id() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "edge-device"


class MqttConfig(Section):
    """``[mqtt]``: the broker, the device id, credentials and the link's timing."""

    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    device_id: str = Field(default_factory=_default_device_id)
    username: str | None = None
    password: SecretStr | None = None
    tls: TlsConfig | None = None
    keepalive_s: int = Field(20, ge=5, le=600)
    topic_prefix: str = "edge/v1"
    reconnect_max_s: float = Field(30.0, ge=1, le=3600, description="longest jittered wait between reconnects")
    max_inflight: int = Field(20, ge=1, le=1000, description="unacknowledged QoS 1 messages at a time")
    homeassistant_discovery: bool = Field(
        False,
        description="publish Home Assistant MQTT discovery (retained): latency, tokens/s, temperature and "
        "tier sensors, and a tier select; turned off, the next start clears what was published",
    )
    homeassistant_prefix: str = Field(
        "homeassistant",
        pattern=r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*$",
        max_length=128,
        description="Home Assistant's discovery prefix",
    )

    @field_validator("device_id")
    @classmethod
    def _topic_safe(cls, value: str) -> str:
        if not value or any(c in value for c in "+#/") or not value.isprintable():
            raise ValueError("must be non-empty, printable and free of '+', '#' and '/' (it is a topic level)")
        return value


# Commands a fleet may send (``telemetry/command_args.py`` ALLOWED); ``telemetry.commands_allowed`` narrows them.
FleetCommand = Literal[
    "get_status", "set_sla", "pin_tier", "unpin_tier", "rebuild_engine", "flush_telemetry", "reset_desired"
]
FLEET_COMMANDS: tuple[FleetCommand, ...] = typing.get_args(FleetCommand)


class TelemetryConfig(Section):
    """``[telemetry]``: the window interval, the spool and the ledger, and what the fleet may command."""

    interval_s: float = Field(10.0, gt=0, le=3600)
    spool_path: Path = Field(default_factory=lambda: _user_dir("state") / "spool.sqlite")
    spool_max_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    spool_max_records: int = Field(100_000, ge=10)
    replay_per_s: float = Field(5.0, gt=0, le=10_000, description="backlog replay rate after an outage")
    ledger_path: Path = Field(default_factory=lambda: _user_dir("state") / "commands.sqlite")
    max_command_bytes: int = Field(16 * 1024, ge=256, le=1024 * 1024)
    commands_allowed: list[FleetCommand] = Field(
        default_factory=lambda: list(FLEET_COMMANDS), description="fleet commands this device runs; [] = none"
    )
    reply_prefixes: list[str] = Field(
        default_factory=lambda: ["fleet/replies/"],
        description="topic prefixes (besides the device's own "
        "<prefix>/<device_id>/cmd/<name>/res and .../res/) that command replies may be sent under",
    )
    fleet_public_key: str | None = Field(
        None,
        description="the fleet's Ed25519 public key (a PEM file or the raw key in base64): when set, "
        "commands and desired must be signed with it (docs/telemetry.md 'Signed commands')",
    )

    @field_validator("reply_prefixes")
    @classmethod
    def _concrete_prefixes(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not p.endswith("/") or len(p) < 2 or any(c in p for c in "+#\0")]
        if bad:
            raise ValueError(f"each prefix must end with '/' and have no '+', '#' or NUL: {bad}")
        return value

    @field_validator("fleet_public_key")
    @classmethod
    def _loadable_key(cls, value: str | None) -> str | None:
        if value:  # a key that cannot be read must stop the agent, never fall back to unsigned
            try:
                load_public_key(value)
            except ConfigError as exc:
                raise ValueError("; ".join(msg for _path, msg in exc.problems)) from None
            except EdgeAgentError as exc:
                raise ValueError(str(exc)) from None
        return value


def _default_recipes_dir() -> Path:
    from .shipped import default_recipes_dir

    return default_recipes_dir()


class EnginesConfig(Section):
    """``[engines]``: the engine cache, where recipes are found, and background builds."""

    cache_dir: Path = Field(default_factory=lambda: default_cache_dir() / "engines")
    max_bytes: int = Field(8 * 1024**3, ge=1024 * 1024)
    recipes_dir: Path = Field(
        default_factory=_default_recipes_dir,
        description="the user's recipes: `--recipe NAME` and background builds look for "
        "NAME.toml here first, then among the shipped recipes (default /etc/edge-agent/engines "
        "under systemd, ~/.config/edge-agent/engines otherwise)",
    )
    build_on_start: bool = Field(
        True,
        description="`edge-agent run`: build a tier's missing engine (when its model "
        "has a recipe) in the background while the model folder serves",
    )
    build_threads: int = Field(
        1, ge=1, le=256, description="intra-op threads of a background build (it shares the device with serving)"
    )


class CalibrationConfig(Section):
    """``[calibration]``: opt-in capture of a sample of real traffic as calibration manifests (off by default:
    captured prompts and voice are personal data; they stay on the device, bounded in count and bytes)."""

    capture_dir: Path | None = Field(
        None,
        description="where captured prompts and utterances go (llm.jsonl, asr.jsonl, asr/*.wav); unset: capture is off",
    )
    capture_rate: float = Field(
        0.05,
        gt=0,
        le=1,
        description="fraction of requests and utterances kept: every 1/rate-th one (0.05: one in twenty; 1.0: all)",
    )
    max_items: int = Field(
        500,
        ge=1,
        le=1_000_000,
        description="per workload; once reached, capture of that "
        "workload stops (the first items are kept, nothing is replaced)",
    )
    max_bytes: int = Field(
        256 * 1024**2,
        ge=1024 * 1024,
        description="total size of the capture directory; beyond it nothing more is written",
    )
    capture_llm: bool = Field(True, description="capture LLM prompts (chat messages or completion prompts)")
    capture_asr: bool = Field(True, description="capture speech utterances (16 kHz mono WAV + the final text)")

    def summary(self) -> str:
        """One line for the start-up summary and ``meta``: ``off``, or what is captured where and how much."""
        kinds = [k for k, on in (("llm", self.capture_llm), ("asr", self.capture_asr)) if on]
        if self.capture_dir is None or not kinds:
            return "off"
        return (
            f"on: {', '.join(kinds)} into {self.capture_dir}, rate {self.capture_rate:g}, "
            f"max {self.max_items} per workload, max {self.max_bytes} bytes"
        )


class ApiConfig(Section):
    """``[api]``: where the local API listens and how a client authenticates."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    unix_socket: Path | None = None
    token: SecretStr | None = None
    allow_unauthenticated: bool = Field(
        False,
        description="serve a host other machines can reach without a "
        "token (the agent then warns at start); off: such a config is refused",
    )

    @field_validator("token")
    @classmethod
    def _token_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty token used to switch authentication off without a word.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is empty: set a secret, or remove the key to serve without one (loopback only)")
        return value

    @model_validator(mode="after")
    def _open_host_needs_token(self) -> ApiConfig:
        if (
            self.unix_socket is None
            and self.token is None
            and not self.allow_unauthenticated
            and not self.is_loopback(self.host)
        ):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no token is set: set "
                "api.token (clients send Authorization: Bearer …), keep host on loopback, or set "
                "api.allow_unauthenticated = true to serve it open on purpose"
            )
        return self

    @staticmethod
    def is_loopback(host: str) -> bool:
        """Whether ``host`` only listens on this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
        import ipaddress

        if host.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
        except ValueError:  # a name other than localhost, or "" (every interface)
            return False


class AudioConfig(Section):
    """``[audio]``: capture, voice-activity detection and the ASR's streaming chunk."""

    device: str | int | None = Field(None, description="sounddevice input name or index; None = default")
    sample_rate: int = Field(16000, ge=8000, le=192000)
    block_ms: int = Field(20, ge=5, le=500)
    vad: Literal["energy", "webrtc", "silero"] = "energy"
    vad_model: Path | None = Field(None, description="silero_vad.onnx when vad = 'silero'")
    energy_threshold_db: float = Field(-50.0, ge=-100.0, le=0.0)
    min_speech_ms: int = Field(100, ge=10, le=5000)
    trailing_silence_ms: int = Field(500, ge=50, le=10_000)
    pre_roll_ms: int = Field(200, ge=0, le=2000)
    max_utterance_s: float = Field(28.0, gt=1.0, le=600.0)
    chunk_ms: int = Field(320, ge=20, le=5000, description="new audio per recogniser step (partial cadence)")

    @model_validator(mode="after")
    def _silero_needs_model(self) -> AudioConfig:
        if self.vad == "silero" and self.vad_model is None:
            raise ValueError("vad = 'silero' needs vad_model (the path of silero_vad.onnx)")
        return self


class LoggingConfig(Section):
    """``[logging]``: the daemon's log level and format."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="`edge-agent run`'s log level")
    format: Literal["text", "json"] = Field(
        "text", description="text, or one JSON object per line (time, level, logger, message) for journald/Loki"
    )


class Settings(BaseSettings):
    """The whole configuration: the TOML file, then ``EDGE_AGENT_*`` environment variables on top."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    device: DeviceConfig = Field(default_factory=DeviceConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    sla: SlaConfig = Field(default_factory=SlaConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    audio: AudioConfig = Field(default_factory=AudioConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file arrives as init kwargs; environment variables override it.
        return (env_settings, init_settings)


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
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc), str(path) if path else "environment") from exc


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"]).replace(".[", "[")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(str(err["loc"][-1]), _section_keys(err["loc"][:-1]))
        elif err["type"] == "literal_error":
            msg = _literal_message(err)
        problems.append((loc or "(root)", msg))
    return problems


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; this section takes {', '.join(choices)}" if choices else ""


def _section_keys(loc: tuple) -> list[str]:
    """The keys the config section at ``loc`` (e.g. ``("models", "llm", 0)``) accepts."""
    model: type[BaseModel] | None = Settings
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section class inside an annotation (``TlsConfig | None``, ``list[TierConfig]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _literal_message(err: Any) -> str:
    """``'onnxrt' is not one of 'onnxruntime', …; did you mean 'onnxruntime'?`` without internal values."""
    expected = re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))
    allowed = [v for v in expected if v not in INTERNAL_BACKENDS]
    if not allowed:
        return err["msg"]
    given = err.get("input")
    hint = _did_you_mean(given, allowed) if isinstance(given, str) else ""
    return f"{given!r} is not one of {', '.join(repr(v) for v in allowed)}" + (hint if "did you" in hint else "")
