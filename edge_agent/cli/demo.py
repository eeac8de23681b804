"""``edge-agent demo``: the daemon on the demo tiers under a mixed chat + speech load, live
(the demo itself is ``edge_agent/demo/run.py``)."""

from __future__ import annotations

from ..demo.run import run


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the daemon on the demo tiers under a mixed chat + speech load, live")
    p.add_argument("--config", metavar="FILE", help="take mqtt.host/port from this config (default: built-in)")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--chat-rate", type=float, default=1.5, help="chat requests/s outside the burst (default 1.5)")
    p.add_argument("--plot", metavar="PNG", default="edge-agent-demo.png")
    p.add_argument("--json", dest="json_out", metavar="OUT")
    p.add_argument("--no-speech", action="store_true", help="chat load only")
    p.set_defaults(func=run)
