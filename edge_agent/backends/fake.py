"""A real, tiny backend for tests and load experiments: settable latency and failures.

It computes a deterministic function of its inputs (by default a float32 output per input, the
input plus one), sleeps for a configurable latency per call (base + per-item in the batch), and
fails calls on demand. Opened from a JSON file::

    {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
     "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
     "latency_ms": 5, "per_item_ms": 1, "fail_every": 0}
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import BackendError, ModelError
from . import SessionOptions, TensorSpec, check_feeds

Compute = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


class FakeSession:
    """A ``Session`` that computes in numpy, with injectable latency and failures, for tests and benchmarks."""

    backend = "fake"

    def __init__(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        compute: Compute | None = None,
        latency_ms: float = 0.0,
        per_item_ms: float = 0.0,
        fail_every: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.compute = compute or self._plus_one
        self.latency_ms = latency_ms
        self.per_item_ms = per_item_ms
        self.fail_every = fail_every
        self.calls = 0
        self.closed = False
        self._sleep = sleep
        self._lock = threading.Lock()

    def _plus_one(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = list(feeds.values())
        return {spec.name: (values[i % len(values)].astype(np.float32) + 1.0) for i, spec in enumerate(self.outputs)}

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if self.closed:
            raise BackendError("fake session is closed")
        check_feeds(self.inputs, feeds)
        with self._lock:
            self.calls += 1
            calls = self.calls
        batch = max((v.shape[0] for v in feeds.values() if v.ndim), default=1)
        delay_ms = self.latency_ms + self.per_item_ms * batch
        if delay_ms > 0:
            self._sleep(delay_ms / 1e3)
        if self.fail_every and calls % self.fail_every == 0:
            raise BackendError(f"fake backend: injected failure on call {calls}")
        out = self.compute(feeds)
        names = output_names if output_names is not None else [s.name for s in self.outputs]
        return {n: out[n] for n in names}

    def close(self) -> None:
        self.closed = True


def _specs(items: list[dict], where: str) -> list[TensorSpec]:
    try:
        return [TensorSpec(i["name"], str(np.dtype(i["dtype"])), tuple(i["shape"])) for i in items]
    except (KeyError, TypeError) as exc:
        raise ModelError(f"{where}: each tensor needs name, dtype and shape ({exc})") from exc


def open(path: Path, options: SessionOptions) -> FakeSession:
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"fake model spec not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}): {exc.msg}") from exc
    return FakeSession(
        _specs(spec.get("inputs", []), f"{path}: inputs"),
        _specs(spec.get("outputs", []), f"{path}: outputs"),
        latency_ms=float(spec.get("latency_ms", 0)),
        per_item_ms=float(spec.get("per_item_ms", 0)),
        fail_every=int(spec.get("fail_every", 0)),
    )
