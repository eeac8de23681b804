"""How ``edge-agent run`` leaves after SIGTERM: normally when every thread finished, else with
``os._exit`` (no interpreter teardown under a thread inside native code, which aborts the process
with ``terminate called…``), exit 0 both ways. Real processes, real signals."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, signal, sys, threading
    from edge_agent.cli import run as run_command
    from edge_agent.systemd import Notifier

    class Stub:
        notifier = Notifier({})
        def start(self):
            threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
            return self
        def cancel_builds(self):
            print("cancel_builds", flush=True)
        def stop(self):
            return sys.argv[1] == "finished"

    atexit.register(lambda: print("interpreter teardown", flush=True))
    print("returned", run_command._serve(Stub()), flush=True)
""")


@pytest.mark.parametrize("how", ["finished", "stuck"])
def test_sigterm_exits_0_and_skips_teardown_only_when_a_build_is_stuck(how):
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cancel_builds" in out.stdout  # the signal handler cancels builds at once
    if how == "finished":
        assert "returned 0" in out.stdout and "interpreter teardown" in out.stdout
    else:
        assert "returned" not in out.stdout and "interpreter teardown" not in out.stdout
