"""Transcript rendering (srt, vtt, verbose_json, text, json) and the transcription form's fields.

Timestamps are checked against the C library's ``strftime``, cue files with a parser written
here, and field refusals by the ``param`` they name."""

from __future__ import annotations

import re
import time

import pytest
from multidict import MultiDict

from edge_agent.errors import InputError
from edge_agent.serving.doors.http.transcript_formats import render, srt, timestamp, verbose_json, vtt
from edge_agent.serving.doors.http.transcription_request import FORMATS, TranscriptionOptions, parse_options


def reference_stamp(seconds: float, sep: str) -> str:
    """The C library's clock formatting (under a day), then the milliseconds."""
    ms = round(seconds * 1000)
    return time.strftime("%H:%M:%S", time.gmtime(ms // 1000)) + f"{sep}{ms % 1000:03d}"


@pytest.mark.parametrize("seconds", [0.0, 0.0004, 0.0006, 1.5, 59.9994, 59.9996, 61.25, 3599.999, 3600.0, 86399.5])
def test_timestamps_match_strftime(seconds):
    assert timestamp(seconds) == reference_stamp(seconds, ",")
    assert timestamp(seconds, ".") == reference_stamp(seconds, ".")


def test_a_negative_time_is_zero():
    assert timestamp(-0.2) == "00:00:00,000"


SEGMENTS = [
    {"id": 0, "start": 0.44, "end": 1.74, "text": "turn on the light", "final_ms": 12.0},
    {"id": 1, "start": 2.0, "end": 2.5, "text": "   "},  # no text: no cue
    {"id": 2, "start": 3.58, "end": 3725.3205, "text": "two\n\nlines --> here"},
]


def cues(body: str, sep: str) -> list[tuple[str, str, str, str]]:
    """(number or '', start, end, text) per cue, by the formats' own grammar: blocks split by blank lines."""
    out = []
    for block in body.strip("\n").split("\n\n"):
        lines = block.split("\n")
        number = lines.pop(0) if sep == "," else ""
        m = re.fullmatch(rf"(\d\d:\d\d:\d\d\{sep}\d{{3}}) --> (\d\d:\d\d:\d\d\{sep}\d{{3}})", lines[0])
        assert m, block
        out.append((number, m[1], m[2], "\n".join(lines[1:])))
    return out


def test_srt_numbers_cues_from_one_and_skips_empty_segments():
    got = cues(srt(SEGMENTS), ",")
    assert [c[0] for c in got] == ["1", "2"]
    assert [(c[1], c[2]) for c in got] == [
        (reference_stamp(0.44, ","), reference_stamp(1.74, ",")),
        (reference_stamp(3.58, ","), reference_stamp(3725.3205, ",")),
    ]
    # a blank line would end the cue and "-->" would read as a timing line: both are removed
    assert got[0][3] == "turn on the light" and got[1][3] == "two\nlines -> here"


def test_vtt_has_its_header_and_dotted_times():
    body = vtt(SEGMENTS)
    assert body.startswith("WEBVTT\n\n")
    got = cues(body[len("WEBVTT\n\n") :], ".")
    assert [(c[1], c[3]) for c in got] == [
        (reference_stamp(0.44, "."), "turn on the light"),
        (reference_stamp(3.58, "."), "two\nlines -> here"),
    ]
    assert vtt([]) == "WEBVTT\n\n"


RESULT = {
    "text": "turn on the light two lines",
    "duration": 4.25,
    "language": "en",
    "segments": SEGMENTS,
    "model": "demo-asr",
    "tier": "ctc",
}


def test_render_each_format():
    assert render(RESULT, "json") == ({"text": RESULT["text"]}, "application/json")
    assert render(RESULT, "text") == (RESULT["text"] + "\n", "text/plain")
    assert render(RESULT, "srt") == (srt(SEGMENTS), "text/plain")
    assert render(RESULT, "vtt") == (vtt(SEGMENTS), "text/plain")
    body, kind = render(RESULT, "verbose_json")
    assert kind == "application/json" and body == verbose_json(RESULT)
    assert isinstance(body, dict)
    assert {k: body[k] for k in ("task", "language", "duration", "text")} == {
        "task": "transcribe",
        "language": "en",
        "duration": 4.25,
        "text": RESULT["text"],
    }
    assert body["segments"] is SEGMENTS and body["model"] == "demo-asr" and body["tier"] == "ctc"
    with pytest.raises(ValueError, match="tsv"):
        render(RESULT, "tsv")


# -- the form's fields ------------------------------------------------------------------------------


def form(*pairs: tuple[str, object]) -> MultiDict:
    return MultiDict([("file", object()), ("model", "edge-agent"), *pairs])


def test_defaults_and_accepted_values():
    assert parse_options(MultiDict([("file", object())])) == TranscriptionOptions("json", None, None)
    for fmt in FORMATS:
        assert parse_options(form(("response_format", fmt))).response_format == fmt
    got = parse_options(
        form(
            ("response_format", "verbose_json"),
            ("language", " en "),
            ("prompt", ""),
            ("temperature", "0.0"),
            ("stream", "false"),
            ("timestamp_granularities[]", "segment"),
        )
    )
    assert got == TranscriptionOptions("verbose_json", "edge-agent", "en")
    assert parse_options(form(("response_format", "srt"), ("timestamp_granularities", "segment")))


@pytest.mark.parametrize(
    "pairs, param, fragment",
    [
        ([("response_format", "tsv")], "response_format", "json, text, srt, vtt, verbose_json"),
        ([("response_format", "json"), ("response_format", "text")], "response_format", "2 times"),
        ([("prompt", "kitchen")], "prompt", "no text prompt"),
        ([("temperature", "warm")], "temperature", "a number"),
        ([("temperature", "nan")], "temperature", "between 0 and 1"),
        ([("temperature", "1.5")], "temperature", "between 0 and 1"),
        ([("temperature", "0.2")], "temperature", "deterministically"),
        ([("stream", "true")], "stream", "/v1/audio/stream"),
        ([("stream", "maybe")], "stream", "true or false"),
        ([("timestamp_granularities[]", "word")], "timestamp_granularities", "not available"),
        ([("timestamp_granularities[]", "phoneme")], "timestamp_granularities", "'phoneme'"),
        ([("timestamp_granularities[]", "segment")], "timestamp_granularities", "'json' has none"),
        ([("include[]", "logprobs")], "include[]", "'include[]'"),
        ([("language", object())], "language", "text field"),
    ],
)
def test_fields_that_cannot_be_honoured_name_themselves(pairs, param, fragment):
    with pytest.raises(InputError) as err:
        parse_options(form(*pairs))
    assert getattr(err.value, "param", None) == param and fragment in str(err.value), str(err.value)


def test_word_times_are_refused_even_beside_segment_times():
    pairs = [("response_format", "verbose_json")]
    pairs += [("timestamp_granularities[]", "segment"), ("timestamp_granularities[]", "word")]
    with pytest.raises(InputError, match="'word' is not available"):
        parse_options(form(*pairs))
