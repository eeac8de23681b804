"""A model whose weights exceed the memory this machine has free is refused before a runtime loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent import backends
from edge_agent.errors import ModelError


def _model(tmp_path: Path, graph_bytes: int, data_bytes: int) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\0" * graph_bytes)
    if data_bytes:
        (tmp_path / "model.onnx.data").write_bytes(b"\0" * data_bytes)
    return path


def test_weights_count_the_external_data_beside_the_graph(tmp_path):
    assert backends.weight_bytes(_model(tmp_path, 100, 5000)) == 5100


@pytest.mark.parametrize(("available", "refused"), [(5099, True), (5100, False), (10**9, False)])
def test_a_model_larger_than_the_free_memory_is_refused_naming_both_sizes(tmp_path, available, refused):
    path = _model(tmp_path, 100, 5000)
    if refused:
        with pytest.raises(ModelError, match=r"model\.onnx: its weights need .* MiB .* has .* MiB available"):
            backends.check_fits_memory(path, available=available)
    else:
        backends.check_fits_memory(path, available=available)


def test_open_session_refuses_before_the_runtime_reads_the_file(tmp_path, monkeypatch):
    path = _model(tmp_path, 100, 5000)  # not a loadable model: a runtime would fail on it differently
    monkeypatch.setattr(backends, "available_memory_bytes", lambda: 1000)
    with pytest.raises(ModelError, match="available"):
        backends.open_session(path, "onnxruntime")
