"""``edge-agent eval llm`` on demo-gemma (real ONNX Runtime): perplexity against one whole forward per window,
log-softmax by hand in numpy; bad input is one line naming the file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, open_session
from edge_agent.cli import main
from edge_agent.models.catalog import resolve_model
from edge_agent.models.perplexity import perplexity
from edge_agent.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "calibration/llm/text/python-reference.txt"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    ref = resolve_model("demo-gemma", tmp_path_factory.mktemp("models"))
    session = open_session(ref.path / "model.onnx", "onnxruntime", SessionOptions(threads=1), warmup=lambda s: None)
    yield ref, session
    session.close()


def whole_window_nll(session, ids: list[int], bos: int, window: int, stride: int) -> tuple[float, int]:
    """Each window in one forward (empty past, every position's logits), log-softmax in numpy."""
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        fed = [bos, *ids[begin:end]]
        feeds = {
            "input_ids": np.asarray([fed], np.int64),
            "attention_mask": np.ones((1, len(fed)), np.int64),
            "position_ids": np.arange(len(fed), dtype=np.int64)[None],
        }
        for spec in session.inputs:
            if spec.name.startswith("past_key_values"):
                feeds[spec.name] = np.zeros((1, 1, 0, 16), np.float32)
        logits = session.run(feeds, ["logits"])["logits"][0].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        logp -= logits.max(-1, keepdims=True)
        token_lp = logp[np.arange(len(fed) - 1), fed[1:]]
        new = end - prev_end
        nll -= float(token_lp[-new:].sum())
        scored += new
        prev_end = end
        if end == len(ids):
            break
    return nll, scored


@pytest.mark.parametrize(("window", "stride", "chunk"), [(96, 48, 32), (96, 96, 7), (400, 100, 400), (64, 30, 256)])
def test_chunked_with_cache_equals_whole_windows(demo, window, stride, chunk) -> None:
    ref, session = demo
    tok = Tokenizer(ref.path, ref.model_type)
    ids = tok.encode(TEXT.read_text(encoding="utf-8")[:3000], add_special_tokens=False)[:300]
    bos = tok.token_id("<bos>")
    assert bos is not None
    nll, scored = whole_window_nll(session, ids, bos, window, stride)
    result = perplexity(session, ids, ref.config, bos=bos, window=window, stride=stride, chunk=chunk)
    assert result.tokens == scored == len(ids)
    assert result.perplexity == pytest.approx(math.exp(nll / scored), rel=1e-5)


def test_cli_reports_perplexity_as_json(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("EDGE_AGENT_MODELS__CACHE_DIR", str(tmp_path / "models"))
    manifest = tmp_path / "held.jsonl"
    manifest.write_text(
        json.dumps({"text": "Turn on the kitchen light."}) + "\n" + json.dumps({"prompt": "What time is it?"}) + "\n"
    )
    args = ["eval", "llm", "--model", "demo-gemma", "--text", str(manifest), "--window", "8", "--stride", "4"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tok = Tokenizer(resolve_model("demo-gemma", tmp_path / "models").path)
    ids = tok.encode("Turn on the kitchen light.\n\nWhat time is it?", add_special_tokens=False)
    assert report["tokens"] == report["text_tokens"] == len(ids)
    assert report["perplexity"] == pytest.approx(math.exp(report["nll"] / report["tokens"]))
    assert main([*args, "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "over 5 tokens scored" in out and "tokens/s" in out


@pytest.mark.parametrize(
    ("content", "model", "says"),
    [
        (None, "demo-gemma", "text file not found"),
        (b"", "demo-gemma", "the text is empty"),
        (b"caf\xe9 au lait", "demo-gemma", "not UTF-8 text"),
        (b"some text", "demo-asr", "not an LLM"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, monkeypatch, capsys, content, model, says) -> None:
    monkeypatch.setenv("EDGE_AGENT_MODELS__CACHE_DIR", str(tmp_path / "models"))
    path = tmp_path / "held-out.txt"
    if content is not None:
        path.write_bytes(content)
    assert main(["eval", "llm", "--model", model, "--text", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert str(path) in err[0] or model in err[0]


PPL_RECIPE = """
name = "tiny-gemma-ppl"
model = "demo-gemma"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8w", "int4"]
[heldout]
data = "{heldout}"
samples = 3
[perplexity]
data = "{text}"
max_tokens = 300
window = 128
stride = 64
chunk = 48
[accuracy]
max_ppl_increase_pct = 1.0
min_greedy_agreement = 0.9
"""


@pytest.mark.slow
def test_the_build_gates_by_perplexity_against_its_own_budget(tmp_path: Path) -> None:
    from edge_agent.engines.cache import EngineCache
    from edge_agent.engines.pipeline import BuildRequest, Heartbeat, Pipeline
    from edge_agent.engines.recipes import load_recipe
    from edge_agent.systemd import Notifier
    from tests.gate_checks import assert_gate_decided, build_gated

    path = tmp_path / "tiny-gemma-ppl.toml"
    path.write_text(PPL_RECIPE.format(heldout=ROOT / "calibration/llm/heldout.jsonl", text=TEXT))
    recipe = load_recipe(path)
    cache = EngineCache(tmp_path / "engines", 1 << 30)
    pipe = Pipeline(recipe, cache, tmp_path / "models", heartbeat=Heartbeat(enabled=False, notifier=Notifier({})))
    fp32 = build_gated(pipe, BuildRequest("cpu", "fp32"))
    m = fp32["accuracy"]["metrics"]
    # The optimized FP32 graph against the source: the same perplexity and the same greedy choices.
    assert m["ppl_increase_pct"] == pytest.approx(0.0, abs=1e-3) and m["greedy_agreement"] == 1.0
    assert m["ppl_tokens"] == 300 and fp32["accuracy"]["passed"]
    assert len(list((cache.root / "perplexity").glob("*.npz"))) == 1  # FP32's result, kept for the others
    for precision in ("int8w", "int4"):
        report = build_gated(pipe, BuildRequest("cpu", precision))
        acc = report["accuracy"]
        assert_gate_decided(acc, recipe.accuracy)
        assert acc["metrics"]["perplexity_fp32"] == m["perplexity_fp32"]
        assert acc["budget"] == {"max_ppl_increase_pct": 1.0, "min_greedy_agreement": 0.9}
        for reason in acc["reasons"]:
            assert any(f"{acc['metrics'][k]:.4f}" in reason for k in ("perplexity", "greedy_agreement"))
    assert len(list((cache.root / "perplexity").glob("*.npz"))) == 1
