"""``Settings``: every section together, read from init kwargs (the TOML file) with ``EDGE_AGENT_*``
environment variables on top."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .api import ApiConfig
from .asr import AsrConfig
from .base import DeviceConfig
from .mqtt import MqttConfig, TelemetryConfig
from .prefix_cache import PrefixCacheConfig
from .runtime import AudioConfig, CalibrationConfig, EnginesConfig, LoggingConfig
from .sla import SlaConfig
from .tiers import BatchingConfig, ModelsConfig
from .wyoming import WyomingConfig

ENV_PREFIX = "EDGE_AGENT_"


class Settings(BaseSettings):
    """The whole configuration: the TOML file, then ``EDGE_AGENT_*`` environment variables on top."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    device: DeviceConfig = Field(default_factory=DeviceConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    sla: SlaConfig = Field(default_factory=SlaConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    audio: AudioConfig = Field(default_factory=AudioConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    wyoming: WyomingConfig = Field(default_factory=WyomingConfig)
    asr: AsrConfig = Field(default_factory=AsrConfig)

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
