"""`systemctl reload` (SIGHUP) of a real `edge-agent run` after an edit to ``[logging]`` and
``[calibration]``: the log level changes at once (debug records start to appear), and the calibration
change is named in STATUS as waiting for a restart (was: neither applied nor mentioned)."""

from __future__ import annotations

import json
import signal

from tests.daemon_proc import Daemon, config_text, wait_for
from tests.e2e.test_daemon_operator import reload_once
from tests.mqtt_broker import Broker


def _levels(out: str) -> list[str]:
    return [json.loads(line)["level"] for line in out.splitlines() if line.startswith("{")]


def test_sighup_applies_the_log_level_and_names_the_calibration_change(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, extra='\n[logging]\nformat = "json"\n')
    try:
        daemon.start()
        assert "DEBUG" not in _levels(daemon.output())
        edited = config_text(daemon.workdir, broker.port, daemon.api_port)
        edited += '\n[logging]\nformat = "json"\nlevel = "debug"\n\n[calibration]\ncapture_rate = 0.5\n'
        daemon.cfg.write_text(edited)
        _, ready = reload_once(daemon)
        assert ready["STATUS"].startswith("reloaded: applied sla, logging level info → debug"), ready
        assert "changes to calibration take effect after a restart" in ready["STATUS"], ready
        # The MQTT client logs each publish at debug; windows go out every second.
        wait_for(lambda: "DEBUG" in _levels(daemon.output()), 20, what="a debug record after the reload")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        daemon.close()
        broker.stop()
