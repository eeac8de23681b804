"""``edge-agent demo``: the daemon on real weights under a mixed chat + speech load, live
(the demo itself is ``edge_agent/demo/run.py``)."""

from __future__ import annotations

from ..demo.run import run


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the daemon on real weights under a mixed chat + speech load, live")
    p.add_argument("--config", metavar="FILE", help="take mqtt.host/port from this config (default: built-in)")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument(
        "--chat-rate",
        type=float,
        default=None,
        help="chat requests/s outside the burst, the burst 4x it (default: sized from the serving tier's measured "
        "capacity, 0.3x outside the burst and 1.5x in it)",
    )
    p.add_argument(
        "--random-models",
        action="store_true",
        help="LLM tiers on the random demo models (code paths and speed only) instead of gemma-3-270m-home",
    )
    p.add_argument("--plot", metavar="PNG", default="edge-agent-demo.png")
    p.add_argument("--json", dest="json_out", metavar="OUT")
    p.add_argument("--no-speech", action="store_true", help="chat load only")
    p.set_defaults(func=run)
