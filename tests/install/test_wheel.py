"""edge-agent as a user gets it: a wheel installed (non-editable) into a fresh venv, run away from the
checkout, and under the environment systemd gives the unit.

The wheel is built from the repository's files (``pip wheel --no-deps``) and installed with
``--no-deps``; its dependencies come from the test's own environment through a ``.pth`` line (no
network, seconds). That line cannot hide a missing dependency declaration, so the wheel's metadata
is checked separately: what ``edge-agent run`` imports must be a core dependency.
"""

from __future__ import annotations

import email.parser
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.daemon_proc import Notify
from tests.mqtt_broker import Broker, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# What `edge-agent run` imports on the embedded default: the API server, /metrics, MQTT, config, runtime,
# and soundfile for an uploaded file on its ASR tier.
RUN_NEEDS = {
    "soundfile",
    "aiohttp",
    "prometheus-client",
    "paho-mqtt",
    "pydantic",
    "pydantic-settings",
    "onnxruntime",
    "numpy",
    "tokenizers",
    "jinja2",
    "platformdirs",
}


def _sources(dest: Path) -> Path:
    """The repository's files (tracked, or new and not ignored): what a wheel is built from."""
    try:
        names = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=REPO,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.wav", "__pycache__"))
        return dest
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _sources(tmp / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            str(src),
            "-w",
            str(tmp / "dist"),
        ],
        check=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    [wheel] = (tmp / "dist").glob("edge_agent-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
        check=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The dependencies: this environment's site-packages, after the venv's own (where edge_agent is).
    (site / "zz-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"tmp": tmp, "wheel": wheel, "venv": venv, "site": site, "exe": venv / "bin" / "edge-agent"}


def _user_env(home: Path) -> dict[str, str]:
    """A login shell's environment: no PYTHONPATH, no systemd variables, no test settings."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
    return {**keep, "HOME": str(home)}


def test_the_wheel_declares_the_daemons_dependencies_and_carries_the_shipped_data(installed) -> None:
    with zipfile.ZipFile(installed["wheel"]) as whl:
        names = set(whl.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    core = {
        r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].split("[")[0].strip().lower().replace("_", "-")
        for r in meta.get_all("Requires-Dist") or []
        if "extra ==" not in r
    }
    assert core >= RUN_NEEDS, f"`pip install edge-agent` would lack {sorted(RUN_NEEDS - core)}"
    assert "build" in meta.get_all("Provides-Extra") and "api" in meta.get_all("Provides-Extra")
    for data in (
        "engines/demo-asr.toml",
        "engines/demo-phi3-small.toml",
        "calibration/asr/calib.jsonl",
        "calibration/asr/heldout.jsonl",
        "calibration/llm/prompts.jsonl",
        "systemd/edge-agent.service",
        "systemd/agent.toml",
        "scripts/train_asr/synth.py",
        "scripts/install-service",
    ):
        assert f"edge_agent/data/{data}" in names, data
    assert not [n for n in names if n.endswith(".wav")], "synthesised audio is made on first use, not shipped"


def test_build_by_recipe_name_from_outside_the_checkout(installed, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = _user_env(home)
    python = str(installed["venv"] / "bin" / "python")
    where = subprocess.run(
        [python, "-c", "import edge_agent; print(edge_agent.__file__)"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(installed["site"]), where  # the wheel's copy, not the checkout
    needs_synth = not (shutil.which("espeak-ng") and shutil.which("sox"))
    done = subprocess.run(
        [
            str(installed["exe"]),
            "build",
            "--recipe",
            "demo-asr",
            "--json",
            "-",
        ],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if needs_synth:  # the calibration audio cannot be made: one clear line, no traceback
        assert done.returncode != 0 and "apt install espeak-ng sox" in done.stderr and "Traceback" not in done.stderr
        pytest.skip("espeak-ng/sox missing: checked the error only")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    built = summary["engines"]
    assert built and all(e["recipe"] == "demo-asr" for e in built)
    cache = home / ".cache" / "edge-agent"
    assert all(Path(e["path"]).is_relative_to(cache / "engines") for e in built if e.get("path"))
    assert "synthesising" in done.stderr and "with espeak-ng" in done.stderr
    # the package's data stays untouched; the audio is made under the user's cache
    assert len(list((cache / "calibration" / "asr" / "calib").glob("*.wav"))) == 100
    assert not list((installed["site"] / "edge_agent" / "data").rglob("*.wav"))


GENERATE_ARGS = ("--max-new-tokens", "16", "--json", "tell me about the weather")


def test_an_npu_tier_under_emulation_from_the_installed_wheel(installed, tmp_path: Path) -> None:
    """The NPU path as installed (the NPU plugin's LLM mode, emulated on the CPU): the same greedy
    tokens as ONNX Runtime on the same demo model, run from / with no checkout."""
    pytest.importorskip("openvino")
    env = _user_env(tmp_path / "home")

    def generate(*backend: str, emulation: str = "off") -> dict:
        done = subprocess.run(
            [str(installed["exe"]), "generate", "--model", "demo-phi3", *backend, "--greedy", *GENERATE_ARGS],
            cwd="/",
            env={**env, "EDGE_AGENT_DEVICE__NPU_EMULATION": emulation},
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    on_npu = generate("--backend", "openvino", "--device", "NPU", emulation="cpu")
    on_cpu = generate("--backend", "onnxruntime")
    assert on_npu["device"] == "NPU" and on_npu["token_ids"] == on_cpu["token_ids"]


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self.path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def _get(sock: Path, url: str) -> tuple[int, str]:
    conn = _UnixHTTP(sock)
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"edge-agent run exited with {proc.returncode} before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def test_the_daemon_from_root_under_the_units_environment(installed, tmp_path: Path) -> None:
    """As the unit starts it: cwd /, the shipped agent.toml, systemd's directory variables, no
    WorkingDirectory, no checkout. It must get READY, serve, start the shipped recipe's background
    build, and stop cleanly on SIGTERM."""
    _run_like_the_unit(installed["exe"], installed["site"], tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to run as another user")
def test_the_daemon_as_its_own_user_like_the_unit(tmp_path_factory: pytest.TempPathFactory) -> None:
    """As root, the unit runs the agent as its own unprivileged user (``User=edge-agent``): nothing it
    needs may require root. Here the user is ``nobody``, the venv is made by the system Python (this
    environment's interpreter may live where other users cannot read), and every folder the daemon
    gets is owned by that user, as systemd's ``StateDirectory=`` & co. make them."""
    system_python = Path("/usr/bin/python3")
    site_deps = Path(sysconfig.get_paths()["purelib"])
    probe = subprocess.run(
        [str(system_python), "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or probe.stdout.strip() != f"{sys.version_info[0]}.{sys.version_info[1]}":
        pytest.skip("no system Python of this minor version to make the unprivileged venv with")
    root = Path(tempfile.mkdtemp(prefix="edge-agent-user-"))
    try:
        root.chmod(0o755)
        venv = root / "venv"
        made = subprocess.run([str(system_python), "-m", "venv", str(venv)], capture_output=True, timeout=120)
        if made.returncode != 0:
            pytest.skip(f"the system Python cannot make a venv: {made.stderr.decode()[-200:]}")
        wheel = next((tmp_path_factory.getbasetemp() / "wheel0" / "dist").glob("edge_agent-*.whl"), None)
        if wheel is None:  # the module's wheel fixture has not run: build one
            wheel_dir = root / "dist"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "-q",
                    str(_sources(root / "src")),
                    "-w",
                    str(wheel_dir),
                ],
                check=True,
                timeout=600,
                stdin=subprocess.DEVNULL,
            )
            [wheel] = wheel_dir.glob("edge_agent-*.whl")
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
            check=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        site = Path(
            subprocess.run(
                [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        (site / "zz-test-dependencies.pth").write_text(f"{site_deps}\n")
        user = "nobody"
        readable = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import numpy, onnxruntime, aiohttp, edge_agent"],
            cwd="/",
            user=user,
            capture_output=True,
            text=True,
        )
        if readable.returncode != 0:
            pytest.skip(f"this environment's packages are not readable by {user}: {readable.stderr[-200:]}")
        work = root / "run"
        work.mkdir(mode=0o755)
        _run_like_the_unit(venv / "bin" / "edge-agent", site, work, user=user)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_like_the_unit(exe: Path, site: Path, tmp_path: Path, user: str | None = None) -> None:
    dirs = {
        name: tmp_path / name.lower()
        for name in (
            "STATE_DIRECTORY",
            "CACHE_DIRECTORY",
            "RUNTIME_DIRECTORY",
            "CONFIGURATION_DIRECTORY",
            "LOGS_DIRECTORY",
        )
    }
    for d in dirs.values():
        d.mkdir(mode=0o750)
        if user is not None:  # systemd makes them owned by the unit's user
            shutil.chown(d, user)
    config = dirs["CONFIGURATION_DIRECTORY"] / "agent.toml"
    shutil.copy(site / "edge_agent" / "data" / "systemd" / "agent.toml", config)
    sock = dirs["RUNTIME_DIRECTORY"] / "api.sock"
    broker = Broker(tmp_path / "broker").start() if shutil.which("mosquitto") else None
    notify = Notify(tmp_path / "notify.sock")
    if user is not None:  # systemd's notify socket accepts any local sender
        notify.path.chmod(0o777)
    env = {
        **_user_env(dirs["STATE_DIRECTORY"]),
        **{k: str(v) for k, v in dirs.items()},
        "INVOCATION_ID": secrets.token_hex(16),
        "NOTIFY_SOCKET": str(notify.path),
        "PYTHONUNBUFFERED": "1",
        "EDGE_AGENT_API__UNIX_SOCKET": str(sock),
        "EDGE_AGENT_MQTT__PORT": str(broker.port if broker else free_port()),
        "EDGE_AGENT_DEVICE__THREADS": "1",
        # the random ladder in place of the example's Gemma 3 tiers (not fetched here): its shipped recipe
        # builds in the background, which is what this run stops
        "EDGE_AGENT_MODELS__LLM": json.dumps([{"name": "small", "model": "demo-phi3-small"}]),
        # and demo-asr in place of the example's Whisper base tier (not fetched here either)
        "EDGE_AGENT_MODELS__ASR": json.dumps([{"name": "ctc", "model": "demo-asr"}]),
    }
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(exe), "run", "--config", str(config)],
            user=user,
            cwd="/",
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        _wait(lambda: notify.seen("READY", "1"), 240, "READY=1", proc, log)
        status, body = _get(sock, "/health")
        assert status == 200 and json.loads(body)["status"], body
        status, metrics = _get(sock, "/metrics")
        assert status == 200 and "edge_agent:" in metrics
        # engines.recipes_dir under systemd is /etc/edge-agent/engines (absent here): the shipped recipe builds
        _wait(
            lambda: notify.seen("STATUS", contains="building engine demo-phi3-small"),
            120,
            "a background build of the shipped demo-phi3-small recipe",
            proc,
            log,
        )
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within 90 s of SIGTERM:\n{log.read_text()[-3000:]}")
        assert code == 0, f"SIGTERM during a background build exited {code}:\n{log.read_text()[-3000:]}"
        assert "ModuleNotFoundError" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
        if broker:
            broker.stop()
