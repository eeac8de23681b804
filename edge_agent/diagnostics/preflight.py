"""Checks a configuration beyond its schema: models exist, backends are installed, files are there.

``check-config`` and ``run`` call ``config_problems``; each problem is ``(dotted.path, message)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..backends import BACKENDS, is_installed
from ..config import ENV_PREFIX, INTERNAL_BACKENDS, Settings, load_settings, read_toml, resolve_config_path
from ..errors import ConfigError, ModelError
from ..models.catalog import DEMO_DIR, DEMO_MODELS, imported_folder, inspect_folder, not_found
from ..models.llm_contract import folder_kv_bytes_per_token


def config_problems(config: str | Path | None) -> list[tuple[str, str]]:
    """Every problem with the configuration at ``config`` (plus environment), schema first, in one
    pass: a file with schema errors still has its tiers' model folders and backends checked."""
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        seen = {path for path, _ in exc.problems}
        return exc.problems + [p for p in _raw_tier_problems(config) if p[0] not in seen]
    return settings_problems(settings)


def _raw_tier_problems(config: str | Path | None) -> list[tuple[str, str]]:
    """Model and backend problems of the tiers as written (file, then ``EDGE_AGENT_MODELS__…``) and
    missing TLS files, for a configuration that failed its schema: each is checked on its own."""
    try:
        path = resolve_config_path(config)
        data = read_toml(path) if path else {}
    except ConfigError:
        return []  # unreadable or not TOML: that is the one problem, already reported
    models = data.get("models")
    if not isinstance(models, dict):
        models = {}
    problems: list[tuple[str, str]] = []
    cache_dir = _raw_cache_dir(models)
    for workload in ("llm", "asr"):
        tiers: Any = models.get(workload)
        env = os.environ.get(f"{ENV_PREFIX}MODELS__{workload.upper()}")
        if env:
            try:
                tiers = json.loads(env)
            except ValueError:
                continue
        for i, tier in enumerate(tiers if isinstance(tiers, list) else []):
            if not isinstance(tier, dict):
                continue
            where = f"models.{workload}[{i}]"
            if isinstance(tier.get("model"), str) and tier["model"]:
                problems += _model_problems(f"{where}.model", tier["model"], workload, cache_dir)
            backend = tier.get("backend", "onnxruntime")
            if backend in BACKENDS and backend not in INTERNAL_BACKENDS and not is_installed(backend):
                problems.append(
                    (f"{where}.backend", f"{backend!r} is not installed here: {BACKENDS[backend].install_hint}")
                )
    mqtt = data.get("mqtt")
    tls = mqtt.get("tls") if isinstance(mqtt, dict) else None
    if not isinstance(tls, dict):
        tls = {}
    for key in ("ca_file", "cert_file", "key_file"):
        if isinstance(tls.get(key), str) and not Path(tls[key]).expanduser().is_file():
            problems.append((f"mqtt.tls.{key}", f"file not found: {tls[key]}"))
    return problems


def _raw_cache_dir(models: dict) -> Path:
    """``[models] cache_dir`` as written (environment first), else the default."""
    from ..config.base import default_cache_dir

    raw = os.environ.get(f"{ENV_PREFIX}MODELS__CACHE_DIR") or models.get("cache_dir")
    return Path(raw).expanduser() if isinstance(raw, str) and raw else default_cache_dir() / "models"


def settings_problems(settings: Settings) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    cache_dir = Path(settings.models.cache_dir).expanduser()
    for workload in ("llm", "asr"):
        for i, tier in enumerate(getattr(settings.models, workload)):
            where = f"models.{workload}[{i}]"
            problems += _model_problems(f"{where}.model", tier.model, workload, cache_dir)
            if not is_installed(tier.backend):
                problems.append(
                    (
                        f"{where}.backend",
                        f"{tier.backend!r} is not installed here: {BACKENDS[tier.backend].install_hint}",
                    )
                )
    tls = settings.mqtt.tls
    if tls:
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(tls, key)
            if path is not None and not Path(path).is_file():
                problems.append((f"mqtt.tls.{key}", f"file not found: {path}"))
    if settings.mqtt.password is not None and settings.mqtt.username is None:
        problems.append(("mqtt.password", "a password needs mqtt.username"))
    return problems + prefix_cache_problems(settings)


def prefix_cache_problems(settings: Settings) -> list[tuple[str, str]]:
    """A prefix cache bound below one block of a tier's model: such a cache could never store a block,
    so it would cache nothing. Each LLM tier that keeps a cache (not on the NPU), its block's bytes read
    from its model folder (``folder_kv_bytes_per_token``); ``run`` refuses to start on these too."""
    from ..backends.npu import is_npu

    pc = settings.prefix_cache
    if not pc.enabled:
        return []
    problems: list[tuple[str, str]] = []
    for tier in settings.models.llm:
        if tier.backend == "openvino" and is_npu(tier.device):
            continue  # runs without the cache (its KV stays inside the runtime)
        folder = _model_folder(tier.model, Path(settings.models.cache_dir))
        per_token = folder_kv_bytes_per_token(folder) if folder is not None else None
        if per_token is None:
            continue  # not a plain ONNX export: the scheduler checks the loaded model at start
        block = per_token * pc.block_tokens
        if pc.max_mb * 2**20 < block:
            problems.append(
                (
                    "prefix_cache.max_mb",
                    f"{pc.max_mb:g} MiB is below one block of LLM tier {tier.name!r} ({pc.block_tokens} tokens of "
                    f"{tier.model}: {block / 2**20:.3g} MiB), so its prefix cache could hold nothing; set "
                    f"max_mb to at least {block / 2**20:.3g} (a useful cache holds many blocks), or "
                    "prefix_cache.enabled = false",
                )
            )
    return problems


def _model_folder(model: str, cache_dir: Path) -> Path | None:
    if model in DEMO_MODELS:
        return DEMO_DIR / model
    folder = Path(model).expanduser()
    return folder if folder.is_dir() else imported_folder(model, cache_dir)


def _model_problems(path: str, model: str, workload: str, cache_dir: Path) -> list[tuple[str, str]]:
    if model in DEMO_MODELS:
        demo = DEMO_MODELS[model]
        if not (DEMO_DIR / model).is_dir():
            return [(path, f"demo model {model!r} is not shipped in this build")]
        if not demo.kind.startswith(workload):
            return [(path, f"{model!r} is a {demo.kind} model, not {workload}")]
        return []
    folder = _model_folder(model, cache_dir)
    if folder is None:
        return [(path, not_found(model, cache_dir))]
    try:
        ref = inspect_folder(folder)
    except ModelError as exc:
        return [(path, str(exc))]
    if not ref.kind.startswith(workload):
        return [(path, f"{folder} holds a {ref.kind} model, not {workload}")]
    return []
