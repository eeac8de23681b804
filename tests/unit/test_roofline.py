"""The decode roofline's pieces: the bound's arithmetic, and the bandwidth it is measured with."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from edge_agent.bench import roofline as rl


def test_bound_is_bandwidth_over_the_bytes_a_step_reads():
    roof = rl.roofline(20.0, 1_000_000_000, 1000, 100.0, 18.0)
    assert roof["bytes_per_token"] == 1_000_100_000
    assert roof["bound_tokens_per_s"] == pytest.approx(20e9 / 1_000_100_000, abs=0.05)
    assert roof["fraction"] == pytest.approx(18.0 / roof["bound_tokens_per_s"], abs=1e-3)


def test_tied_embeddings_are_read_every_step():
    config = {"vocab_size": 100, "hidden_size": 8}
    assert rl.embedding_gather_bytes(config) == 99 * 8 * 4
    assert rl.embedding_gather_bytes({**config, "tie_word_embeddings": True}) == 0


def test_kv_bytes_count_keys_and_values_of_every_layer():
    assert rl.kv_bytes_per_token_of_context(6, 8, 64, "float16") == 2 * 6 * 8 * 64 * 2


def test_matmul_bandwidth_is_the_runtimes_batch1_matmul_time():
    pytest.importorskip("onnx")
    gb_s = rl.measure_matmul_bandwidth_gb_s(threads=1, size_mb=8, repeats=3)
    assert gb_s is not None and np.isfinite(gb_s) and gb_s > 0
    assert rl.measure_bandwidth(1)[1] == "onnxruntime-matmul"


def test_without_onnx_the_bandwidth_falls_back_to_numpy(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ImportError
    assert rl.measure_matmul_bandwidth_gb_s(1) is None
    gb_s, method = rl.measure_bandwidth(1)
    assert method == "numpy-sum" and gb_s > 0
