"""edge-agent: an inference daemon for edge boxes (TensorRT, OpenVINO, ONNX Runtime)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("edge-agent")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+source"
