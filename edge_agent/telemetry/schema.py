"""Wire payloads of every MQTT topic under ``edge/v1/<device_id>/``, as pydantic models.

Each payload carries ``schema`` (``edge-agent.<name>/<major>``): a receiver checks the name and
refuses a major it does not know; minor additions are new optional fields. The JSON Schema files
under ``schemas/`` are generated from these models and checked in, so fleet tools can validate
without Python:

    python -m edge_agent.telemetry.schema --write    # regenerate after changing a model
    python -m edge_agent.telemetry.schema --check    # exit 1 when a file is stale (a test runs this)

Pydantic runs at this edge only (once per window, event or command), never per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .wire import (
    COMMAND_STATUSES,
    NAME,
    UINT64_MAX,
    WINDOW_METRICS,
    WORKLOAD,
    MetricName,
    Wire,
    schema_id,
)
from .wire_device import Desired, Inventory, Meta, Reported, ServingEngine, SlaSpec, SourceKey, SourceValue, State
from .wire_events import CommandRequest, CommandResponse, Event, SpoolDrop
from .wire_latency import (
    Admission,
    Buckets,
    Health,
    Histogram,
    LatencyWindow,
    LocalQuantiles,
    Refusals,
    Series,
    Throughput,
    WindowTimes,
)

__all__ = [
    "COMMAND_STATUSES",
    "NAME",
    "PAYLOADS",
    "SCHEMA_DIR",
    "SCHEMA_VERSIONS",
    "UINT64_MAX",
    "WINDOW_METRICS",
    "WORKLOAD",
    "Admission",
    "Buckets",
    "CommandRequest",
    "CommandResponse",
    "Desired",
    "Event",
    "Health",
    "Histogram",
    "Inventory",
    "LatencyWindow",
    "LocalQuantiles",
    "Meta",
    "MetricName",
    "Refusals",
    "Reported",
    "Series",
    "ServingEngine",
    "SlaSpec",
    "SourceKey",
    "SourceValue",
    "SpoolDrop",
    "State",
    "Throughput",
    "Wire",
    "WindowTimes",
    "json_schemas",
    "main",
    "render",
    "schema_id",
    "stale_files",
    "write_files",
]

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


PAYLOADS: dict[str, type[Wire]] = {
    "tele_latency": LatencyWindow,
    "state": State,
    "meta": Meta,
    "reported": Reported,
    "desired": Desired,
    "event": Event,
    "cmd_request": CommandRequest,
    "cmd_response": CommandResponse,
}
SCHEMA_VERSIONS = {name: model.model_fields["schema_"].default for name, model in PAYLOADS.items()}


def json_schemas() -> dict[str, dict[str, Any]]:
    out = {}
    for name, model in PAYLOADS.items():
        schema = model.model_json_schema(by_alias=True, mode="serialization")
        schema["$id"] = f"https://edge-agent.invalid/schemas/{name}.json"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[name] = schema
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def stale_files(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of schema files that are missing or differ from the models."""
    stale = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.json"
        if not path.is_file() or path.read_text() != render(schema):
            stale.append(path.name)
    return stale


def write_files(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.json"
        path.write_text(render(schema))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m edge_agent.telemetry.schema", description="generate or check the checked-in JSON Schema files"
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help=f"write {SCHEMA_DIR}")
    g.add_argument("--check", action="store_true", help="exit 1 if a file is missing or stale")
    args = p.parse_args(argv)
    if args.write:
        for path in write_files():
            print(path)
        return 0
    stale = stale_files()
    if stale:
        print(
            f"stale JSON Schema files in {SCHEMA_DIR}: {', '.join(stale)}; "
            "run: python -m edge_agent.telemetry.schema --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
