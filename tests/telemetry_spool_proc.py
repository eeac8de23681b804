"""An agent process for the spool fault tests: telemetry under load, logging like the daemon,
until it is killed.

    python -m tests.telemetry_spool_proc PORT WORKDIR INTERVAL_S

The spool lives in WORKDIR (a small tmpfs in the disk-full test); the log goes to stderr with the
daemon's format, at INFO, so a test can count every line a fault makes it write.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from tests.telemetry_helpers import Load, make_telemetry


def main() -> None:
    port, workdir, interval = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tele = make_telemetry(workdir, port, interval_s=interval, live_age_s=0.5).start()
    print(f"session {tele.spool.session}", flush=True)
    with Load(tele, per_s=100):
        while True:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
