"""The trained demo speech model (demo-asr): contract, PyTorch reference, streaming, accuracy, CLI.

Real runtimes (ONNX Runtime; OpenVINO CPU where installed) and real speech synthesised at test time
with espeak-ng + sox from the recipes in calibration/asr/heldout.jsonl (held-out sentences and voices).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.audio.features import LogMelConfig, log_mel
from edge_agent.audio.wav import read_audio
from edge_agent.metrics.wer import error_rates
from edge_agent.models.asr_streaming_ctc import StreamingCtcRunner
from edge_agent.models.catalog import resolve_model

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "edge_agent" / "demo_models" / "demo-asr"
HELDOUT = REPO / "calibration" / "asr" / "heldout.jsonl"
N_SPOKEN = 40  # held-out utterances synthesised per test run (about 3 s of synthesis)
# Bounds about 8 points above the committed model's WER on these 40 utterances (greedy 21.8%,
# lexicon 7.3%, lm 2.1%; the model card has the 200-utterance table), the lm one at the 10% the
# model must meet: a regression of the model, the features or the decoders breaks them, run-to-run
# noise does not (the audio is deterministic).
MAX_WER = {"greedy": 0.30, "lexicon": 0.15, "lm": 0.10}


def _synth():
    """scripts/train_asr/synth.py (numpy + espeak-ng + sox: no torch), imported by path."""
    if "asr_synth" not in sys.modules:
        spec = importlib.util.spec_from_file_location("asr_synth", REPO / "scripts" / "train_asr" / "synth.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["asr_synth"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["asr_synth"]


def _need_speech_tools() -> None:
    import shutil

    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("speech synthesis needs espeak-ng and sox (apt install espeak-ng sox)")


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first N_SPOKEN held-out utterances as WAVs, synthesised now, with their manifest."""
    _need_speech_tools()
    out = tmp_path_factory.mktemp("heldout")
    lines = HELDOUT.read_text().splitlines()[:N_SPOKEN]
    manifest = out / "heldout.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    assert _synth().regenerate(manifest) == N_SPOKEN
    return manifest


@pytest.fixture(scope="module", params=["onnxruntime", "openvino"])
def runner(request: pytest.FixtureRequest):
    if importlib.util.find_spec(request.param) is None:
        pytest.skip(f"{request.param} is not installed")
    r = StreamingCtcRunner(FOLDER, request.param)
    yield r
    r.close()


def test_folder_follows_the_streaming_ctc_contract() -> None:
    ref = resolve_model("demo-asr", Path("/nonexistent-cache"))
    assert (ref.kind, ref.model_type, ref.path) == ("asr-ctc-streaming", "streaming-ctc", FOLDER)
    config = json.loads((FOLDER / "config.json").read_text())
    vocab = json.loads((FOLDER / "vocab.json").read_text())
    pre = json.loads((FOLDER / "preprocessor_config.json").read_text())
    assert config["vocab_size"] == len(vocab) and vocab["<pad>"] == config["blank_id"] == 0
    assert config["word_delimiter"] in vocab
    assert config["chunk_frames"] % config["subsampling"] == 0 and config["flush_frames"] % config["subsampling"] == 0
    assert pre["feature_extractor_type"] == "LogMelFeatureExtractor" and pre["center"] is False
    assert pre["mel_scale"] == "slaney" and pre["feature_size"] == pre["num_mel_bins"] == len(pre["mean"])
    contract = json.loads((FOLDER / "io_contract.json").read_text())["model.onnx"]
    names = [i["name"] for i in contract["inputs"]], [o["name"] for o in contract["outputs"]]
    n = len(config["state_shapes"])
    assert names == (
        ["features"] + [f"state_in.{i}" for i in range(n)],
        ["log_probs"] + [f"state_out.{i}" for i in range(n)],
    )
    for spec in contract["inputs"][1:]:
        assert spec["shape"][1:] == config["state_shapes"][spec["name"]]
    assert (FOLDER / "model.onnx").stat().st_size < 8_500_000
    lexicon = (FOLDER / "lexicon.txt").read_text().split()
    assert {"kitchen", "forty", "percent", "o'clock"} <= set(lexicon)
    assert (FOLDER / "README.md").is_file()


def test_runtime_features_equal_training_features(reference: dict[str, np.ndarray]) -> None:
    cfg = LogMelConfig.from_preprocessor(FOLDER)
    feats = log_mel(reference["samples"], cfg)
    n = feats.shape[0]
    assert np.array_equal(feats, reference["features"][:n])  # computed by the same code in training
    assert (reference["features"][n:] == cfg.padding_value).all()  # the flush frames


def test_backend_reproduces_pytorch_reference(runner: StreamingCtcRunner, reference: dict[str, np.ndarray]) -> None:
    spec = runner.spec
    zeros = {k: np.zeros((1, *s), np.float32) for k, s in spec.state_shapes.items()}
    out = runner.session.run({"features": reference["features"][None], **zeros})
    np.testing.assert_allclose(out["log_probs"][0], reference["log_probs"], atol=2e-4)
    for i in range(len(spec.state_shapes)):
        np.testing.assert_allclose(out[f"state_out.{i}"][0], reference[f"state_out_{i}"], atol=2e-4)
    assert (out["log_probs"][0].argmax(-1) == reference["greedy_ids"]).mean() > 0.99
    batch = reference["batch_features"]
    zeros2 = {k: np.zeros((2, *s), np.float32) for k, s in spec.state_shapes.items()}
    np.testing.assert_allclose(
        runner.session.run({"features": batch, **zeros2})["log_probs"], reference["batch_log_probs"], atol=2e-4
    )
    assert runner.decode(out["log_probs"][0]) == runner.decode(reference["log_probs"])


@pytest.mark.parametrize("push", [1600, 333, 5120])
def test_streamed_equals_whole(runner: StreamingCtcRunner, reference: dict[str, np.ndarray], push: int) -> None:
    samples = reference["samples"]
    streamed, stream = runner.stream(samples, chunk_samples=push)
    whole = runner.full(samples)
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-4)
    assert runner.decode(streamed) == runner.decode(whole) == runner.decode(reference["log_probs"])
    assert runner.decode(streamed, "lexicon") == runner.decode(whole, "lexicon")
    real_frames = log_mel(samples, runner.spec.features).shape[0]
    assert len(stream.chunk_ms) == real_frames // runner.spec.chunk_frames + 1  # full chunks + the flushed tail


@pytest.mark.slow
def test_held_out_speech_is_recognised(spoken: Path) -> None:
    from edge_agent.audio.wav import read_audio

    items = [json.loads(line) for line in spoken.read_text().splitlines()]
    r = StreamingCtcRunner(FOLDER)
    pairs: dict[str, list[tuple[str, str]]] = {d: [] for d in MAX_WER}
    try:
        for item in items:
            samples, _ = read_audio(spoken.parent / item["audio"])
            lp, _ = r.stream(samples)
            for decoder in MAX_WER:
                pairs[decoder].append((item["text"], r.decode(lp, decoder)))  # type: ignore[arg-type]
    finally:
        r.close()
    for decoder, bound in MAX_WER.items():
        words, _ = error_rates(pairs[decoder])
        assert words.ref_len > 200
        assert words.rate <= bound, (decoder, words, pairs[decoder][:10])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_agent", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def test_eval_cli_end_to_end(spoken: Path, tmp_path: Path) -> None:
    tiny = spoken.parent / "tiny.jsonl"
    tiny.write_text("\n".join(spoken.read_text().splitlines()[:3]) + "\n")
    out = tmp_path / "report.json"
    done = _cli("eval", "asr", "--model", "demo-asr", "--data", str(tiny), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "stream/greedy" in done.stdout and "RTF" in done.stdout
    report = json.loads(out.read_text())
    assert report["utterances"] == 3 and report["model"] == "demo-asr"
    assert set(report["results"]) == {
        f"{m}/{d}" for m in ("stream", "full", "service") for d in ("greedy", "lexicon", "lm")
    }
    for r in report["results"].values():
        assert r["wer"]["ref_len"] > 0 and 0 <= r["wer"]["rate"] <= 1 and 0 <= r["cer"]["rate"] <= 1
    assert report["latency"]["rtf"] > 0 and report["latency"]["count"] == 3
    # the first stable word: after some speech, never past the longest clip
    lines = tiny.read_text().splitlines()
    longest = max(len(read_audio(spoken.parent / json.loads(line)["audio"])[0]) / 16000 for line in lines)
    assert (
        0 < report["latency"]["first_stable_ms_p50"] <= report["latency"]["first_stable_ms_p95"] <= longest * 1e3 + 200
    )
    assert "first stable word at" in done.stdout
    assert report["stream_vs_full_max_abs_diff"] < 1e-3
    # --json without a file: only JSON on stdout; default model = the top configured ASR tier (demo-asr here;
    # the embedded default is Whisper base, fetched)
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[[models.asr]]\nname = "ctc"\nmodel = "demo-asr"\n')
    done = _cli("eval", "asr", "--config", str(cfg), "--data", str(tiny), "--json", "--decoder", "greedy")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["results"]) == {"stream/greedy", "full/greedy", "service/greedy"}


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"audio": "a.wav", "text": "x"}', "{not json"], "bad.jsonl:2: not valid JSON"),
        (['{"text": "no audio"}'], 'bad.jsonl:1: expected {"audio"'),
        (['{"audio": "missing.wav", "text": "x"}'], "bad.jsonl:1: audio file missing.wav not found"),
        (['{"audio": "a.wav"}'], 'bad.jsonl:1: no reference "text"'),
        (['{"audio": "corrupt.wav", "text": "x"}'], "bad.jsonl:1: "),
        ([""], "bad.jsonl: the manifest has no utterances"),
    ],
)
def test_eval_cli_bad_manifests(tmp_path: Path, lines: list[str], message: str) -> None:
    _synth().write_wav(tmp_path / "a.wav", np.zeros(8000, np.float32))
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00not a wave file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    done = _cli("eval", "asr", "--model", "demo-asr", "--data", str(bad))
    assert done.returncode == 1
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_missing_manifest_and_wrong_model_kind(tmp_path: Path) -> None:
    done = _cli("eval", "asr", "--model", "demo-asr", "--data", str(tmp_path / "none.jsonl"))
    assert done.returncode == 1 and "none.jsonl: no such manifest" in done.stderr
    _synth().write_wav(tmp_path / "a.wav", np.zeros(8000, np.float32))
    (tmp_path / "m.jsonl").write_text('{"audio": "a.wav", "text": "x"}\n')
    done = _cli("eval", "asr", "--model", "demo-ctc", "--data", str(tmp_path / "m.jsonl"))
    assert done.returncode == 1 and "streaming-ctc" in done.stderr
