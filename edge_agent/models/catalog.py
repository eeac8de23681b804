"""Where models come from: demo models by name, or a folder a user exported.

A model reference is a demo name (``demo-phi3`` …) or a folder path. Folders are recognised by
the files real exporters write:

- ``optimum-cli export onnx`` / ``torch.onnx.export`` decoder: ``model.onnx`` + ``config.json``
  (+ ``tokenizer.json``): kind ``llm``;
- onnxruntime-genai: ``genai_config.json``: kind ``llm`` (ONNX Runtime only);
- OpenVINO IR: ``openvino_model.xml``: kind ``llm`` (OpenVINO only);
- Whisper: ``encoder_model.onnx`` + ``decoder_model.onnx`` (+ ``decoder_with_past_model.onnx``): ``asr-whisper``;
- CTC (wav2vec2 / Conformer-CTC style): ``model.onnx`` + ``vocab.json``: ``asr-ctc``;
- stateful streaming CTC (``config.json`` ``model_type`` ``streaming-ctc``, docs/asr-models.md):
  ``model.onnx`` + ``vocab.json`` + ``preprocessor_config.json``: ``asr-ctc-streaming``.

Imported models (``edge-agent models import`` / ``models fetch``) live in ``<cache>/imported/<name>`` and
are addressable by that name too.

``demo-phi3-small`` is too big to commit (115 MB): its graph and a weight recipe ship with the
package and the weights are generated with numpy on first use, into the model cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ModelError, ModelNotFound

log = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_models"
# what ``edge-agent models fetch`` takes (importers.fetch: FETCHABLE and the adapted models), named here so a
# missing one's error says how to get it
FETCHABLE_NAMES = ("gemma-3-270m", "gemma-3-270m-home", "whisper-base")
IMPORTED = "imported"  # <models cache>/imported/<name>: what models import and models fetch write
Kind = Literal["llm", "asr-whisper", "asr-ctc", "asr-ctc-streaming"]


@dataclass(frozen=True, slots=True)
class DemoModel:
    """A demo model addressable by name: its kind, a description, whether its weights are generated on first use."""

    name: str
    kind: Kind
    description: str
    materialized: bool = False  # weights generated into the cache on first use


DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        DemoModel("demo-phi3", "llm", "Phi-3-mini architecture, tiny, random weights"),
        DemoModel("demo-gemma", "llm", "Gemma architecture (multi-query attention), tiny, random weights"),
        DemoModel(
            "demo-gemma2", "llm", "Gemma-2 architecture (GQA, soft-capping, sliding window), tiny, random weights"
        ),
        DemoModel("demo-phi3-small", "llm", "Phi-3 architecture, 28.6 M parameters, random weights (benchmarks)", True),
        DemoModel(
            "demo-whisper",
            "asr-whisper",
            "Whisper architecture (encoder + decoder with KV cache), tiny, random weights",
        ),
        DemoModel("demo-ctc", "asr-ctc", "wav2vec2-CTC architecture, tiny, random weights"),
        DemoModel(
            "demo-asr",
            "asr-ctc-streaming",
            "streaming CTC (conv + GRU), 1.8 M parameters, trained on espeak-ng voice-assistant speech",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A resolved model: where its files are and what kind of model it is."""

    name: str
    path: Path  # the folder
    kind: Kind
    model_type: str  # config.json model_type: phi3, gemma, gemma2, whisper, wav2vec2, … ("genai", "openvino-ir")
    config: dict


def demo_status(model: DemoModel, cache_dir: Path) -> str:
    src = DEMO_DIR / model.name
    if not src.is_dir():
        return "not shipped in this build"
    if model.materialized:
        return "ready" if (cache_dir / model.name / "model.onnx.data").is_file() else "weights made on first use"
    return "ready"


def resolve_model(
    ref: str | Path,
    cache_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> ModelRef:
    """Resolve a demo name or a folder to a ``ModelRef``, materializing demo weights if needed."""
    text = str(ref)
    if text in DEMO_MODELS:
        demo = DEMO_MODELS[text]
        folder = DEMO_DIR / demo.name
        if not folder.is_dir():
            raise ModelNotFound(f"demo model {text!r} is not shipped in this build of edge-agent")
        if demo.materialized:
            folder = _materialize(folder, cache_dir / demo.name, progress)
        return inspect_folder(folder, name=text)
    path = Path(text).expanduser()
    if path.is_dir():
        return inspect_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            raise ModelError(f"{path} is a GGUF file: import it first (edge-agent models import {path})")
        raise ModelError(f"{path} is a file; give the model folder that contains it (with config.json)")
    imported = imported_folder(text, cache_dir)
    if imported is not None:
        return inspect_folder(imported, name=text)
    raise ModelNotFound(not_found(text, cache_dir))


def imported_folder(name: str, cache_dir: Path) -> Path | None:
    """``<cache>/imported/<name>`` when ``models import`` / ``models fetch`` wrote it, else None."""
    folder = Path(cache_dir) / IMPORTED / name
    return folder if "/" not in name and folder.is_dir() else None


def not_found(text: str, cache_dir: Path) -> str:
    """Why ``text`` names no model here, and how to get it when the registry carries it."""
    if text in FETCHABLE_NAMES:
        return f"model {text!r} is not here yet: get it with `edge-agent models fetch {text}`"
    return (
        f"no model {text!r}: not a demo model ({', '.join(DEMO_MODELS)}), not an imported model in "
        f"{Path(cache_dir) / IMPORTED} and no such folder (real weights: edge-agent models fetch NAME)"
    )


def imported_models(cache_dir: Path) -> list[Path]:
    """The folders ``models import`` / ``models fetch`` wrote, addressable by name."""
    root = Path(cache_dir) / IMPORTED
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def _materialize(src: Path, dst: Path, progress: Callable[[int, int], None] | None) -> Path:
    data = dst / "model.onnx.data"
    stamp = dst / "weights.json"
    if data.is_file() and stamp.is_file() and stamp.read_bytes() == (src / "weights.json").read_bytes():
        return dst
    from ..demo_models.materialize import materialize

    log.info("generating demo weights for %s into %s (once)", src.name, dst)
    try:
        return materialize(src, dst, progress=progress)
    except ValueError as exc:
        raise ModelError(f"could not generate the weights of {src.name}: {exc}") from exc


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc


def inspect_folder(folder: Path, name: str | None = None) -> ModelRef:
    """Recognise an exported model folder; say exactly which file is missing when it is incomplete."""
    folder = folder.resolve()
    name = name or folder.name
    files = {p.name for p in folder.iterdir()}
    if "genai_config.json" in files:
        genai = _read_json(folder / "genai_config.json")
        decoder = genai.get("model", {}).get("decoder", {}) if isinstance(genai.get("model"), dict) else {}
        _require(folder, files, [str(decoder.get("filename", "model.onnx")), "tokenizer.json"])
        return ModelRef(name, folder, "llm", "genai", genai)
    if "config.json" not in files:
        raise ModelError(f"{folder}: no config.json (the file exporters write next to the .onnx files)")
    config = _read_json(folder / "config.json")
    model_type = str(config.get("model_type", ""))
    if "encoder_model.onnx" in files or model_type == "whisper":
        _require(folder, files, ["encoder_model.onnx", "decoder_model.onnx", "tokenizer.json"])
        return ModelRef(name, folder, "asr-whisper", model_type or "whisper", config)
    if model_type == "streaming-ctc":
        _require(folder, files, ["model.onnx", "vocab.json", "preprocessor_config.json"])
        return ModelRef(name, folder, "asr-ctc-streaming", model_type, config)
    if "vocab.json" in files and ("model.onnx" in files) and "tokenizer.json" not in files:
        return ModelRef(name, folder, "asr-ctc", model_type or "ctc", config)
    if "openvino_model.xml" in files:
        _require(folder, files, ["openvino_model.bin", "tokenizer.json"])
        return ModelRef(name, folder, "llm", "openvino-ir", config)
    # a TensorRT engine's folder (the build's artifact) holds its plan in place of the graph
    graph = "model.plan" if "model.plan" in files and "model.onnx" not in files else "model.onnx"
    _require(folder, files, [graph, "tokenizer.json"])
    return ModelRef(name, folder, "llm", model_type, config)


def _require(folder: Path, files: set[str], needed: list[str]) -> None:
    missing = [f for f in needed if f not in files]
    if missing:
        raise ModelError(f"{folder}: missing {', '.join(missing)}; a complete export has {', '.join(needed)}")
