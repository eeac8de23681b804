"""``edge-agent transcribe`` end to end (in process): JSON, partials, and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from edge_agent.cli import main
from tests.speech import speech_samples, speech_wav, two_utterances

KEYS = {"text", "first_partial_ms", "final_ms", "rtf", "utterances", "partials"}


def transcribe(capsys, *argv):
    code = main(["transcribe", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.parametrize("model", ["demo-ctc", "demo-whisper"])
def test_transcribe_json_has_text_and_latencies(capsys, model):
    code, out, err = transcribe(capsys, speech_wav("turn on the kitchen lights"), "--model", model, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) >= KEYS
    assert result["text"] and result["rtf"] > 0 and result["final_ms"] >= 0
    assert result["first_partial_ms"] is not None and len(result["partials"]) >= 2
    assert len(result["utterances"]) == 1 and result["utterances"][0]["reason"] == "silence"


def test_transcribe_text_output_prints_partials_with_timestamps_then_the_final(capsys):
    code, out, err = transcribe(capsys, speech_wav("what time is it"), "--model", "demo-ctc")
    assert code == 0
    assert out.strip() and "final:" in err and "s] …" in err and "first partial" in err


def test_transcribe_stream_replays_in_real_time(capsys):
    wav = speech_wav("lights off", lead_s=0.2, tail_s=0.6)
    code, out, err = transcribe(capsys, wav, "--model", "demo-ctc", "--stream", "--json")
    result = json.loads(out)
    assert code == 0 and result["paced"] is True
    assert result["wall_s"] >= result["audio_s"] - 0.05  # it took as long as the audio lasts
    assert result["text"] and result["first_partial_ms"] is not None


def test_no_vad_and_beam_decoding(capsys):
    x = speech_samples("open the door")
    code, out, _ = transcribe(
        capsys, speech_wav("open the door"), "--model", "demo-ctc", "--no-vad", "--json", "--decoder", "beam"
    )
    r = json.loads(out)
    assert code == 0 and r["utterances"][0]["reason"] == "end_of_stream"
    assert r["utterances"][0]["audio_s"] == pytest.approx(len(x) / 16000, abs=0.02)


@pytest.mark.parametrize(
    "rate, channels, subtype",
    [
        (44100, 1, "PCM_16"),
        (8000, 1, "PCM_16"),
        (48000, 2, "PCM_24"),
        (16000, 1, "PCM_U8"),
        (16000, 1, "PCM_32"),
        (22050, 2, "FLOAT"),
        (16000, 1, "DOUBLE"),
    ],
)
def test_any_rate_channels_and_sample_format_transcribe(capsys, tmp_path, rate, channels, subtype):
    wav = speech_wav(
        "play some music",
        rate=rate,
        channels=channels,
        bits={"PCM_16": 16, "PCM_24": 24, "PCM_U8": 8, "PCM_32": 32, "FLOAT": 32, "DOUBLE": 64}[subtype],
        encoding={"PCM_U8": "unsigned-integer", "FLOAT": "floating-point", "DOUBLE": "floating-point"}.get(
            subtype, "signed-integer"
        ),
    )
    assert sf.info(str(wav)).subtype == subtype and sf.info(str(wav)).samplerate == rate
    code, out, err = transcribe(capsys, wav, "--model", "demo-ctc", "--json")
    assert code == 0, err
    assert json.loads(out)["text"]


def test_silence_gives_empty_text_and_a_warning(capsys, tmp_path):
    path = tmp_path / "silence.wav"
    sf.write(path, np.zeros(32000, np.float32), 16000)
    code, out, err = transcribe(capsys, path, "--model", "demo-ctc", "--json")
    r = json.loads(out)
    assert code == 0 and r["text"] == "" and r["utterances"] == [] and any("silence" in w for w in r["warnings"])


def test_clipped_audio_transcribes_with_a_warning(capsys, tmp_path):
    x = np.clip(speech_samples("turn it up") * 20, -1, 1)
    path = tmp_path / "clipped.wav"
    sf.write(path, x, 16000)
    code, out, _ = transcribe(capsys, path, "--model", "demo-ctc", "--json")
    r = json.loads(out)
    assert code == 0 and r["text"] and any("clipping" in w for w in r["warnings"])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: sf.write(p, np.zeros(0, np.float32), 16000), "no audio"),
        (lambda p: p.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt "), "not a readable audio file"),
        (lambda p: p.write_text("hello"), "not a readable audio file"),
    ],
)
def test_bad_files_exit_1_with_one_line(capsys, tmp_path, make, message):
    path = tmp_path / "bad.wav"
    make(path)
    code, out, err = transcribe(capsys, path, "--model", "demo-ctc", "--json")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_truncated_file_is_transcribed_or_refused_cleanly(capsys, tmp_path):
    data = speech_wav("turn on the kitchen lights").read_bytes()
    path = tmp_path / "cut.wav"
    path.write_bytes(data[: len(data) * 2 // 3 + 1])
    code, out, err = transcribe(capsys, path, "--model", "demo-ctc", "--json")
    assert code == 0 and "Traceback" not in err
    r = json.loads(out)
    assert any("truncated" in w for w in r["warnings"]) and r["audio_s"] > 0


def test_missing_file_and_unknown_model(capsys, tmp_path):
    code, _, err = transcribe(capsys, tmp_path / "nope.wav", "--model", "demo-ctc")
    assert code == 1 and "no such audio file" in err
    code, _, err = transcribe(capsys, speech_wav("hello"), "--model", "no-such-model")
    assert code == 1 and "no-such-model" in err


def test_listen_stdin_respond_reports_turn_latency(tmp_path):
    """The voice turn as a subprocess: PCM on stdin → transcript → LLM reply, turn_ms per utterance."""
    x = two_utterances("what is the capital of france", "and of spain")
    pcm = (x * 32767).astype("<i2").tobytes()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "listen",
            "--stdin",
            "--model",
            "demo-ctc",
            "--respond",
            "--llm-model",
            "demo-phi3",
            "--max-new-tokens",
            "8",
            "--max-utterances",
            "1",
            "--json",
        ],
        input=pcm,
        capture_output=True,
        timeout=240,
        env={**__import__("os").environ, "CACHE_DIRECTORY": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    report = json.loads(proc.stdout)
    (utt,) = report["utterances"]
    assert utt["text"] and utt["turn_ms"] is not None and utt["turn_ms"] > 0
    assert isinstance(utt["response"], str)
    assert report["summary"]["turn_ms"]["count"] == 1 and report["summary"]["final_ms"]["count"] >= 1


def _listen_tools(tmp_path, tools_file, *extra: str) -> subprocess.CompletedProcess:
    x = two_utterances("turn on the kitchen lights", "set a timer for ten minutes")
    pcm = (x * 32767).astype("<i2").tobytes()
    return subprocess.run(
        [
            *(sys.executable, "-m", "edge_agent", "listen", "--stdin", "--model", "demo-asr", "--respond"),
            *("--llm-model", "demo-phi3-small", "--tools", str(tools_file), "--json", *extra),
        ],
        input=pcm,
        capture_output=True,
        timeout=300,
        env={**__import__("os").environ, "CACHE_DIRECTORY": str(tmp_path / "cache")},
    )


def test_listen_with_tools_turns_each_spoken_command_into_a_schema_valid_call(tmp_path):
    """TieredSpeech → transcript → one tool call whose arguments follow the declared schema (random LLM
    weights: only the format is guaranteed), turn_ms from the end of speech to the complete call."""
    import jsonschema

    from edge_agent.demo_models import __file__ as demo_init

    tools_file = __import__("pathlib").Path(demo_init).parent / "home-tools.json"
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in json.loads(tools_file.read_text())["tools"]}
    proc = _listen_tools(tmp_path, tools_file)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    report = json.loads(proc.stdout)
    assert len(report["utterances"]) >= 1
    for utt in report["utterances"]:
        call = utt["tool_call"]
        assert call["name"] in declared
        jsonschema.validate(call["arguments"], declared[call["name"]])
        assert utt["turn_ms"] is not None and utt["turn_ms"] > 0
    assert report["summary"]["turn_ms"]["count"] == len(report["utterances"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2", "not JSON"),
        ('{"tools": []}', "expected a list of tools"),
        ('[{"type": "function", "function": {"name": "bad name!"}}]', "tools[0].function.name"),
    ],
)
def test_a_bad_tools_file_is_refused_before_listening(tmp_path, content, message):
    bad = tmp_path / "tools.json"
    bad.write_text(content)
    proc = _listen_tools(tmp_path, bad)
    err = proc.stderr.decode()
    assert proc.returncode != 0 and message in err and str(bad) in err and "Traceback" not in err
