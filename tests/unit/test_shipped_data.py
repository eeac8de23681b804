"""Shipped recipes and calibration data found by name from anywhere; synthesised calibration audio
made on first use."""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import pytest

from edge_agent.config import EnginesConfig
from edge_agent.engines import synth_audio
from edge_agent.engines.datasets import manifest_digest, read_audio_manifest
from edge_agent.engines.recipes import find_recipe, load_recipe, recipe_files
from edge_agent.errors import ConfigError, InputError
from edge_agent.shipped import default_recipes_dir, engines_dir

REPO = Path(__file__).resolve().parents[2]
SYNTH = {
    "voice": "en-us",
    "speed_wpm": 170,
    "pitch": 50,
    "gain_db": -6.0,
    "lead_s": 0.25,
    "tail_s": 0.1,
    "noise": "",
    "snr_db": 30.0,
    "rt60_s": 0.0,
    "seed": 7,
}
needs_espeak = pytest.mark.skipif(bool(synth_audio.missing_tools()), reason="espeak-ng and sox are not installed")


def test_a_shipped_recipe_is_found_by_name_from_any_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing named engines/ here
    recipe = load_recipe("demo-asr", tmp_path / "user-recipes")
    assert recipe.source == (REPO / "engines" / "demo-asr.toml").resolve()
    assert recipe.resolve(recipe.calibration.data) == (REPO / "calibration" / "asr" / "calib.jsonl").resolve()


def test_the_users_recipe_hides_the_shipped_one_of_the_same_name(tmp_path: Path) -> None:
    user = tmp_path / "engines"
    user.mkdir()
    text = (engines_dir() / "demo-asr.toml").read_text().replace("samples = 100", "samples = 5")
    (user / "demo-asr.toml").write_text(text)
    assert load_recipe("demo-asr", user).calibration.samples == 5
    names = [p.stem for p in recipe_files(user)]
    assert names[0] == "demo-asr" and names.count("demo-asr") == 1 and "demo-phi3-small" in names
    assert recipe_files(user)[0].parent == user


def test_a_copied_recipe_finds_the_shipped_calibration_unless_it_has_its_own(tmp_path: Path) -> None:
    user = tmp_path / "etc" / "engines"
    user.mkdir(parents=True)
    shutil.copy(engines_dir() / "demo-phi3-small.toml", user / "mine.toml")
    recipe = load_recipe("mine", user)
    assert recipe.resolve(recipe.heldout.data) == (REPO / "calibration" / "llm" / "heldout.jsonl").resolve()
    own = tmp_path / "etc" / "calibration" / "llm" / "heldout.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text('{"prompt": "hello"}\n')
    assert recipe.resolve(recipe.heldout.data) == own


def test_an_unknown_recipe_names_every_folder_it_looked_in(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        find_recipe("no-such-recipe", tmp_path / "user")
    assert str(tmp_path / "user") in str(info.value) and str(engines_dir()) in str(info.value)
    with pytest.raises(ConfigError, match="recipe file not found"):
        find_recipe(tmp_path / "missing.toml")


def test_the_recipes_dir_is_etc_under_systemd_and_the_users_config_otherwise(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_recipes_dir() == tmp_path / "xdg" / "edge-agent" / "engines"
    assert EnginesConfig().recipes_dir == tmp_path / "xdg" / "edge-agent" / "engines"
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    assert EnginesConfig().recipes_dir == Path("/etc/edge-agent/engines")
    monkeypatch.delenv("INVOCATION_ID")
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    assert default_recipes_dir() == Path("/etc/edge-agent/engines")


def _manifest(folder: Path, lines: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "set.jsonl"
    path.write_text(
        "".join(
            json.dumps({"audio": f"clips/{i}.wav", "text": "turn on the lights", "synth": {**SYNTH, "seed": i}}) + "\n"
            for i in range(lines)
        )
    )
    return path


def _seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.getnframes() / w.getframerate()


@needs_espeak
def test_missing_synthesised_audio_is_made_beside_a_writable_manifest(tmp_path: Path, capsys) -> None:
    path = _manifest(tmp_path / "data")
    samples = read_audio_manifest(path, need_text=True)
    assert [s.audio for s in samples] == [(tmp_path / "data" / "clips" / f"{i}.wav").resolve() for i in range(2)]
    # lead and tail silence plus a spoken phrase (espeak-ng at 170 wpm: about a second)
    assert all(0.35 + 0.5 < _seconds(s.audio) < 0.35 + 4.0 for s in samples)
    assert "synthesising 2 WAVs of set.jsonl with espeak-ng" in capsys.readouterr().err
    before = samples[0].audio.stat().st_mtime_ns
    assert manifest_digest(path) == manifest_digest(path)  # present now: nothing is made again
    assert samples[0].audio.stat().st_mtime_ns == before


@needs_espeak
def test_audio_of_a_read_only_manifest_goes_to_the_cache(tmp_path: Path, monkeypatch) -> None:
    path = _manifest(tmp_path / "pkg", lines=1)
    monkeypatch.setattr(synth_audio, "is_packaged", lambda p: True)  # as the wheel's own data is
    [sample] = read_audio_manifest(path)
    assert sample.audio.is_relative_to(tmp_path / "cache" / "calibration")  # CACHE_DIRECTORY (conftest)
    assert not (tmp_path / "pkg" / "clips").exists()
    assert (sample.audio.parent.parent / "set.jsonl").read_bytes() == path.read_bytes()


def test_without_espeak_the_error_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    path = _manifest(tmp_path / "data")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(InputError, match=r"set.jsonl: 2 audio files are synthesised.*espeak-ng and sox.*apt install"):
        read_audio_manifest(path)
