"""Copy-paste examples of every MQTT payload, built from the wire models of ``schema.py``.

Each example is a model instance (so it is valid by construction and follows the models as they
grow); a unit test also validates each against the checked-in JSON Schemas and checks that the
"Example payloads" section of docs/telemetry.md is what this module writes:

    python -m edge_agent.telemetry.examples --markdown   # print the section
    python -m edge_agent.telemetry.examples --write      # rewrite it in docs/telemetry.md
    python -m edge_agent.telemetry.examples --check      # exit 1 when the docs are stale

Every command comes with a ``mosquitto_pub`` line (MQTT 5 response topic and correlation data) and
the response messages of its lifecycle.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..metrics.histogram import relative_error
from . import schema
from .command_args import ALLOWED, describe
from .schema import (
    SCHEMA_VERSIONS,
    CommandRequest,
    CommandResponse,
    Desired,
    Event,
    LatencyWindow,
    Meta,
    Reported,
    SlaSpec,
    State,
    WindowTimes,
    Wire,
)
from .windows import WindowAccumulator

DEVICE = "dev-17"
PREFIX = "edge/v1"
WALL = 1767225600.0  # 2026-01-01T00:00:00Z: fixed, so the generated docs do not change per run
REPLY_TOPIC = f"fleet/replies/{DEVICE}"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"
BEGIN = "<!-- BEGIN example payloads: python -m edge_agent.telemetry.examples --write -->"
END = "<!-- END example payloads -->"

SLA = SlaSpec(metric="ttft_ms", percentile=95, target_ms=800, window_s=30, min_samples=20)

# evt/<type>: the data each emitter sends (serving.tiers.control, engines, agent, publisher, remote_commands).
EVENT_DATA: dict[str, dict[str, Any]] = {
    "tier_switch": {
        "workload": "llm",
        "from": "large",
        "to": "small",
        "action": "downgrade",
        "reason": "ttft_ms P95 1240 ms > 800 ms",
        "snapshot": {
            "metric": "ttft_ms",
            "percentile": 95.0,
            "value_ms": 1240.5,
            "count": 64,
            "rate_per_s": 2.1,
            "target_ms": 800.0,
            "window_s": 30.0,
        },
    },
    "tier_switch_failed": {"workload": "llm", "from": "small", "to": "large", "error": "out of memory"},
    "tier_load_failed": {"workload": "asr", "tier": "base", "error": "model folder not found"},
    "engine_build": {
        "workload": "llm",
        "recipe": "phi3-int8",
        "tiers": ["small"],
        "state": "started",
        "reason": "missing",
    },
    "engine_swap": {"workload": "llm", "tier": "small", "ok": True, "serving": "engine:3f9a1c2b"},
    "engine_quarantined": {
        "workload": "llm",
        "tier": "small",
        "key": "3f9a1c2b",
        "reason": "crashed twice while loading",
    },
    "spool_drop": {"reason": "full", "windows": 12, "events": 0, "bytes": 98304, "seq_ranges": [[1041, 1052]]},
    "clock_jump": {"jump_s": -3600.2, "clock_synced": True},
    "commands_dropped": {"counts": {"queue_full": 31}, "total": 31, "period_s": 10.0},
}

# cmd/<name>/req: the arguments and the ``succeeded`` result (what ``remote.RemoteTarget`` returns).
COMMANDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "get_status": (
        {},
        {
            "version": "0.9.0",
            "uptime_s": 3600.4,
            "mqtt_connected": True,
            "active_tiers": {"llm": "small"},
            "pins": {},
            "llm_load": {"waiting": 0, "running": 1},
        },
    ),
    "set_sla": ({"workload": "llm", "sla": SLA.model_dump()}, {"sla": SLA.model_dump()}),
    "pin_tier": ({"workload": "llm", "tier": "small"}, {"pinned": "small"}),
    "unpin_tier": ({"workload": "llm"}, {"pinned": None}),
    "rebuild_engine": ({"recipe": "phi3-int8"}, {"recipe": "phi3-int8", "state": "queued", "tiers": ["small"]}),
    "flush_telemetry": ({}, {"flushed": True}),
    "reset_desired": ({}, {"forgotten_version": 42, "reload": "config reloaded", "desired_version": None}),
}


@dataclass(frozen=True)
class Example:
    """One payload on one topic: the model instance and how it is published."""

    topic: str  # below <prefix>/<device_id>/, or a reply topic
    payload: Wire
    note: str = ""

    @property
    def schema_name(self) -> str:
        return next(name for name, model in schema.PAYLOADS.items() if isinstance(self.payload, model))

    def json(self) -> dict[str, Any]:
        return json.loads(self.payload.to_json())


def _window() -> LatencyWindow:
    acc = WindowAccumulator()
    rng = random.Random(17)  # seeded: a plausible spread of latencies, the same in every run (not a measurement)
    for _ in range(30):
        acc.observe(
            "llm",
            "small",
            "demo-phi3-small",
            {"ttft_ms": [round(rng.lognormvariate(5.6, 0.5), 1)], "itl_ms": [round(rng.lognormvariate(3.2, 0.3), 1)]},
            tokens_out=64,
            engine_hash="engine:3f9a1c2b",
        )
    for _ in range(10):
        acc.observe(
            "asr",
            "base",
            "demo-asr",
            {
                "first_partial_ms": [round(rng.lognormvariate(5.6, 0.4), 1)],
                "final_ms": [round(rng.lognormvariate(6.1, 0.4), 1)],
            },
        )
    extra: dict[str, Any] = {}
    health_model = getattr(schema, "Health", None)
    if health_model is not None and "health" in LatencyWindow.model_fields:
        extra["health"] = health_model.model_validate(
            {
                "process_cpu_percent": 87.5,
                "process_rss_bytes": 734003200,
                "load_1m": 1.42,
                "temperatures_c": {"x86_pkg_temp": 63.0},
                "max_temp_c": 63.0,
                "absent": ["nvpmodel", "ina3221"],
            }
        )
    return LatencyWindow(
        device_id=DEVICE,
        session=3,
        boot_id="5c1e0d7a-0b6e-4f7e-9a7e-2d0f3b1c9e11",
        seq=1042,
        clock_synced=True,
        version="0.9.0",
        series=[s.to_series(10.0) for s in acc.take()],
        window=WindowTimes(start_wall=WALL - 10, end_wall=WALL, start_mono=5000.0, end_mono=5010.0, duration_s=10.0),
        **extra,
    )


def topic_examples() -> list[Example]:
    """One example per device topic (``evt/<type>`` once per event type)."""
    out = [
        Example(
            "state",
            State(device_id=DEVICE, state="online", session=3, boot_id="5c1e0d7a", version="0.9.0", at_wall=WALL),
            "retained; the Last Will is the same with state offline",
        ),
        Example(
            "meta",
            Meta(
                device_id=DEVICE,
                version="0.9.0",
                capabilities=["llm", "asr"],
                tiers={"llm": ["large", "small"], "asr": ["base"]},
                engines={"small": "engine:3f9a1c2b"},
                schemas=dict(SCHEMA_VERSIONS),
                histogram_relative_error=round(relative_error(5), 6),
            ),
            "retained",
        ),
        Example(
            "reported",
            Reported(
                device_id=DEVICE,
                active_tiers={"llm": "small", "asr": "base"},
                pins={"llm": "small"},
                sla={"llm": SLA},
                desired_version=42,
                sources={"sla.llm": "desired@42", "pins.llm": "command"},
                at_wall=WALL,
            ),
            "retained",
        ),
        Example("tele/latency", _window(), "one window; histograms merge across devices"),
    ]
    for n, (type_, data) in enumerate(EVENT_DATA.items()):
        out.append(
            Example(
                f"evt/{type_}",
                Event(device_id=DEVICE, type=type_, session=3, seq=310 + n, at_wall=WALL, at_mono=5010.0, data=data),
            )
        )
    out.append(
        Example(
            "desired",
            Desired(version=43, sla={"llm": SLA}, pins={"llm": "small"}),
            'retained, fleet -> device; pins {"llm": null} unpins',
        )
    )
    return out


def command_examples(name: str) -> tuple[CommandRequest, list[CommandResponse]]:
    """The request of ``name`` and the responses of its lifecycle (accepted, executing, succeeded)."""
    args, result = COMMANDS[name]
    ALLOWED[name].model_validate(args)  # the example must be what the device accepts
    cmd_id = f"{name.replace('_', '-')}-1"
    req = CommandRequest(cmd_id=cmd_id, args=args)
    res = [
        CommandResponse(
            device_id=DEVICE,
            cmd_id=cmd_id,
            command=name,
            status=status,
            at_wall=WALL,
            result=result if status == "succeeded" else None,
        )
        for status in ("accepted", "executing", "succeeded")
    ]
    return req, res


def rejected_example() -> CommandResponse:
    """What ``get_status`` with ``{}`` gets: the device's own wording of the missing ``cmd_id``."""
    try:
        CommandRequest.model_validate_json(b"{}")
    except ValidationError as exc:
        reason = f"malformed request: {describe(exc)}"
    else:  # pragma: no cover - the model requires cmd_id
        raise AssertionError("CommandRequest accepted {} without a cmd_id")
    return CommandResponse(device_id=DEVICE, command="get_status", status="rejected", reason=reason, at_wall=WALL)


def minimal_request(name: str) -> str:
    """The shortest payload the device accepts for ``name`` (``schema`` and empty ``args`` may be left out)."""
    req, _ = command_examples(name)
    body: dict[str, Any] = {"cmd_id": req.cmd_id}
    if req.args:
        body["args"] = req.args
    return json.dumps(body, separators=(",", ":"))


def mosquitto_pub(name: str, host: str = "localhost") -> str:
    req, _ = command_examples(name)
    return (
        f"mosquitto_pub -h {host} -V mqttv5 -q 1 -t {PREFIX}/{DEVICE}/cmd/{name}/req "
        f"-D publish response-topic {REPLY_TOPIC} -D publish correlation-data {req.cmd_id} "
        f"-m {shlex.quote(minimal_request(name))}"
    )


_SCALAR_LIST = re.compile(r"\[\s*([-0-9.e, \n\"A-Za-z_]*?)\s*\]")


def _dump(model: BaseModel | dict[str, Any], compact: bool = False) -> str:
    doc = json.loads(model.to_json()) if isinstance(model, Wire) else model
    if compact:
        return json.dumps(doc, separators=(",", ":"))
    # Indented, but a list of numbers or names stays on one line (bucket counts would fill pages).
    return _SCALAR_LIST.sub(
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",") if x.strip()) + "]",
        json.dumps(doc, indent=2),
    )


def markdown() -> str:
    """The "Example payloads" section of docs/telemetry.md (between the markers)."""
    lines = [
        BEGIN,
        "",
        f"Device `{DEVICE}`, prefix `{PREFIX}`; generated from `edge_agent/telemetry/examples.py` "
        "(a test validates each against `edge_agent/telemetry/schemas/`).",
        "",
    ]
    for ex in topic_examples():
        note = f" ({ex.note})" if ex.note else ""
        lines += [f"#### `{ex.topic}` — `{ex.json()['schema']}`{note}", "", "```json", _dump(ex.payload), "```", ""]
    lines += [
        "### Commands",
        "",
        "Watch the replies, then send a command (MQTT 5; `cmd_id` is required, "
        "`schema` and an empty `args` may be left out):",
        "",
        "```bash",
        f"mosquitto_sub -h localhost -V mqttv5 -t {REPLY_TOPIC} -v",
        "```",
        "",
    ]
    for name in COMMANDS:
        req, res = command_examples(name)
        lines += [
            f"#### `cmd/{name}/req`",
            "",
            "```bash",
            mosquitto_pub(name),
            "```",
            "",
            "Full request:",
            "",
            "```json",
            _dump(req, compact=True),
            "```",
            "",
            f"Responses on `{REPLY_TOPIC}` (without a response topic: `{PREFIX}/{DEVICE}/cmd/{name}/res`), "
            "one per status change:",
            "",
            "```json",
            *(_dump(r, compact=True) for r in res),
            "```",
            "",
        ]
    lines += [
        "A request without `cmd_id` (e.g. `get_status` with `{}`) is answered:",
        "",
        "```json",
        _dump(rejected_example(), compact=True),
        "```",
        "",
        END,
    ]
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {BEGIN!r} ... {END!r} are missing from {DOCS}")
    return text[:start] + section + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m edge_agent.telemetry.examples",
        description="example payloads of every topic and command, for docs/telemetry.md",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the docs section")
    g.add_argument("--write", action="store_true", help=f"rewrite the section in {DOCS}")
    g.add_argument("--check", action="store_true", help="exit 1 when the docs section is stale")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    text = DOCS.read_text()
    fresh = replace_section(text, markdown())
    if args.write:
        DOCS.write_text(fresh)
        print(DOCS)
        return 0
    if fresh != text:
        print(
            f"the example payloads in {DOCS} are stale; run: python -m edge_agent.telemetry.examples --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
