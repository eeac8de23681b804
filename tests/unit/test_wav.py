"""Audio files: every sample format and layout is read as 16 kHz mono; bad files are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from edge_agent.audio.resample import Resampler, resample
from edge_agent.audio.sources import FileSource, StdinSource
from edge_agent.audio.wav import probe, read_audio, to_mono
from edge_agent.errors import InputError

RATE = 16000


def tone(seconds: float = 0.5, rate: int = RATE, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
def test_every_sample_format_reads_as_float_mono(tmp_path, subtype):
    path = tmp_path / f"{subtype}.wav"
    sf.write(path, tone(), RATE, subtype=subtype)
    samples, info = read_audio(path)
    assert samples.dtype == np.float32 and samples.ndim == 1 and samples.size == RATE // 2
    assert info.subtype == subtype
    tol = 0.02 if subtype == "PCM_U8" else 1e-3
    np.testing.assert_allclose(samples, tone(), atol=tol)


def test_flac_reads(tmp_path):
    path = tmp_path / "a.flac"
    sf.write(path, tone(), RATE, subtype="PCM_16")
    samples, info = read_audio(path)
    np.testing.assert_allclose(samples, tone(), atol=1e-3)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_rates_are_resampled_to_16k(tmp_path, rate):
    path = tmp_path / f"r{rate}.wav"
    sf.write(path, tone(1.0, rate), rate, subtype="PCM_16")
    samples, info = read_audio(path)
    assert info.sample_rate == rate
    assert abs(samples.size - RATE) <= 1
    want = tone(1.0)
    np.testing.assert_allclose(samples[400:-400], want[400 : samples.size - 400], atol=5e-3)


def test_stereo_is_averaged_and_reported(tmp_path):
    path = tmp_path / "st.wav"
    left, right = tone(amp=0.4), tone(amp=0.2)
    sf.write(path, np.stack([left, right], axis=1), RATE, subtype="FLOAT")
    samples, info = read_audio(path)
    assert info.channels == 2
    np.testing.assert_allclose(samples, (left + right) / 2, atol=1e-6)
    assert any("channels averaged" in w for w in info.warnings)


def test_silence_and_clipping_are_warnings_not_errors(tmp_path):
    sf.write(tmp_path / "s.wav", np.zeros(RATE, np.float32), RATE)
    _, info = read_audio(tmp_path / "s.wav")
    assert any("silence" in w for w in info.warnings)
    loud = np.clip(tone(amp=3.0), -1, 1)
    sf.write(tmp_path / "c.wav", loud, RATE)
    _, info = read_audio(tmp_path / "c.wav")
    assert any("clipping" in w for w in info.warnings)


def test_nan_and_out_of_range_floats_are_sanitised(tmp_path):
    x = tone()
    x[10], x[20], x[30] = np.nan, np.inf, 7.0
    sf.write(tmp_path / "f.wav", x, RATE, subtype="FLOAT")
    samples, _ = read_audio(tmp_path / "f.wav")
    assert np.isfinite(samples).all() and np.abs(samples).max() <= 1.0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_text("this is not audio at all\n" * 20), "not a readable audio file"),
        (lambda p: sf.write(p, np.zeros((0,), np.float32), RATE), "no audio"),
    ],
)
def test_unusable_files_are_clear_errors(tmp_path, make, message):
    path = tmp_path / "bad.wav"
    make(path)
    with pytest.raises(InputError) as err:
        read_audio(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no such audio file"):
        probe(tmp_path / "nope.wav")


def test_truncated_wav_reads_what_is_there_or_fails_clearly(tmp_path):
    path = tmp_path / "t.wav"
    sf.write(path, tone(1.0), RATE, subtype="PCM_16")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 1])  # cut mid-sample, header still says 1 s
    samples, info = read_audio(path)  # what is there is usable, and the cut is reported
    assert 0 < samples.size < RATE
    assert any(f"declares {RATE} frames" in w for w in info.warnings), info.warnings
    path.write_bytes(data[:30])  # cut inside the header
    with pytest.raises(InputError):
        read_audio(path)


def test_to_mono_rejects_odd_shapes():
    with pytest.raises(InputError):
        to_mono(np.zeros((2, 2, 2)))


@pytest.mark.parametrize("rate_in, rate_out", [(48000, 16000), (44100, 16000), (8000, 16000), (16000, 16000)])
def test_streaming_resampler_equals_one_shot_for_any_blocks(rate_in, rate_out):
    x = np.random.default_rng(0).standard_normal(rate_in).astype(np.float32) * 0.1
    whole = resample(x, rate_in, rate_out)
    r, parts, i = Resampler(rate_in, rate_out), [], 0
    for size in np.random.default_rng(1).integers(1, 2500, size=1000):
        if i >= x.size:
            break
        parts.append(r.push(x[i : i + size]))
        i += size
    parts.append(r.flush())
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert whole.size == -(-x.size * rate_out // rate_in)


def test_downsampling_removes_what_cannot_be_represented():
    high = tone(1.0, 48000, freq=10000.0)  # above 8 kHz: must vanish, not alias to 6 kHz
    y = resample(high, 48000, 16000)
    assert np.sqrt(np.mean(y[500:-500] ** 2)) < 2e-3


def test_file_source_paces_with_an_injected_clock(tmp_path):
    sf.write(tmp_path / "a.wav", tone(1.0), RATE)
    now = [0.0]
    slept = []

    def sleep(d):
        slept.append(d)
        now[0] += d

    src = FileSource(tmp_path / "a.wav", block_ms=100, paced=True, clock=lambda: now[0], sleep=sleep)
    blocks = list(src.blocks())
    assert len(blocks) == 10 and sum(b.size for b in blocks) == RATE
    assert now[0] == pytest.approx(1.0)  # delivered in real time
    fast = FileSource(tmp_path / "a.wav", block_ms=100, paced=False, clock=lambda: 0.0, sleep=pytest.fail)
    assert sum(b.size for b in fast.blocks()) == RATE


@pytest.mark.parametrize(
    "fmt, dtype, scale", [("s16le", "<i2", 32767), ("s32le", "<i4", 2**31 - 1), ("f32le", "<f4", 1.0)]
)
def test_stdin_pcm_any_format_rate_and_channels(fmt, dtype, scale):
    import io

    x = tone(0.5, 48000)
    stereo = np.stack([x, x], axis=1)
    raw = (stereo * scale).astype(dtype).tobytes() + b"\x01"  # a stray trailing byte is ignored
    src = StdinSource(io.BytesIO(raw), fmt=fmt, rate=48000, channels=2)
    out = np.concatenate(list(src.blocks()))
    assert abs(out.size - 8000) <= 1 and src.dropped_bytes == 1
    np.testing.assert_allclose(out[300:-300], tone(0.5)[300 : out.size - 300], atol=5e-3)


def test_truncated_flac_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.flac"
    sf.write(path, (np.random.default_rng(0).standard_normal(32000) * 0.1).astype(np.float32), RATE)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="unreadable or truncated"):
        read_audio(path)
