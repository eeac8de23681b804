"""An agent process for kill -9 tests: telemetry under load until killed.

python -m tests.telemetry_agent_proc PORT WORKDIR INTERVAL_S
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.telemetry_helpers import Load, make_telemetry


def main() -> None:
    port, workdir, interval = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    tele = make_telemetry(workdir, port, interval_s=interval, live_age_s=0.5).start()
    print(f"session {tele.spool.session}", flush=True)
    with Load(tele, per_s=100):
        while True:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
