"""Fault tests: each reproduces a field fault from outside, against a real ``edge-agent run``
process, a real mosquitto and real HTTP/WebSocket/MQTT clients, on loopback only, with bounded
loops. Every test here is marked ``faults``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "/faults/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)
