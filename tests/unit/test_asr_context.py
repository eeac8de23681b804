"""The words a recogniser is told to expect: built from a voice turn's tools and the operator's words,
bounded for Whisper's 224 prompt tokens, carried by each stream into Whisper's decoder as
``<|startofprev|> words <|startoftranscript|> ...`` (demo-whisper, random weights: the token plumbing,
not what it hears), and kept per stream by the ASR service (a fake recogniser records what it was given)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from edge_agent.models.asr_prompt import ENUM_VALUES, TOOL_CHARS, build_prompt, tool_words

HOME_TOOLS = json.loads(
    (Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models" / "home-tools.json").read_text()
)["tools"]


def test_the_home_tools_give_their_descriptions_names_enum_values_and_parameters():
    words, cut = tool_words(HOME_TOOLS)
    assert not cut
    for w in ("Switch a room's light on or off, or dim it", "set light", "set timer", "living room", "hallway"):
        assert w in words
    assert "brightness" in words and "celsius" in words and "minutes" in words
    prompt = build_prompt(HOME_TOOLS, ["Anna", "garage"], ["turn on the kitchen light"])
    assert prompt.startswith("Anna, garage ")  # the operator's words first
    assert prompt.endswith("turn on the kitchen light")  # the last turn nearest the utterance
    assert "Start a countdown timer." in prompt and "kitchen, living room, bedroom" in prompt


def test_a_ten_thousand_value_enum_is_cut_and_said_once(caplog):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "play_song",
                "description": "Play a song",
                "parameters": {
                    "type": "object",
                    "properties": {"title": {"enum": [f"song {i}" for i in range(10_000)]}},
                },
            },
        }
    ]
    with caplog.at_level(logging.INFO, logger="edge_agent.models.asr_prompt"):
        first = build_prompt(tools)
        again = build_prompt(tools)
    assert first == again
    assert len(first) <= TOOL_CHARS + 2
    assert "song 0" in first and f"song {ENUM_VALUES}" not in first
    assert sum("left out" in r.getMessage() for r in caplog.records) == 1


def test_malformed_tools_are_skipped_and_nothing_gives_an_empty_prompt():
    assert build_prompt(None) == "" and build_prompt([]) == ""
    odd = [1, "x", {"function": {"name": 5, "parameters": {"properties": [1, 2]}}}, {"function": "no"}]
    assert build_prompt(odd) == ""


# -- Whisper ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from edge_agent.backends import SessionOptions
    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import resolve_model

    engine = open_recognizer(
        resolve_model("demo-whisper", tmp_path_factory.mktemp("models")), "onnxruntime", SessionOptions(threads=1)
    )
    yield engine
    engine.close()


class _Recording:
    """A session proxy keeping the ``input_ids`` of every run."""

    def __init__(self, session) -> None:
        self.session, self.calls = session, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, feeds, outputs=None):
        self.calls.append(np.array(feeds["input_ids"]))
        return self.session.run(feeds, outputs) if outputs is not None else self.session.run(feeds)


def test_context_ids_are_startofprev_then_the_words_last_223_tokens_kept(whisper):
    prev = whisper.tokenizer.token_to_id("<|startofprev|>")
    ids = whisper.context_ids("kitchen   light")
    assert ids[0] == prev and whisper.tokenizer.decode(ids[1:]) == " kitchen light"
    assert whisper.context_ids("") == [] and whisper.context_ids("   ") == []
    long = " ".join(f"word{i}" for i in range(3000))
    ids = whisper.context_ids(long)
    assert len(ids) == 224 and ids[0] == prev
    assert whisper.tokenizer.decode(ids[1:]).endswith("word2999")


def test_the_context_goes_before_the_prompt_in_the_decoders_first_step(whisper, monkeypatch):
    rec, past = _Recording(whisper.decoder), _Recording(whisper.decoder_past)
    monkeypatch.setattr(whisper, "decoder", rec)
    monkeypatch.setattr(whisper, "decoder_past", past)
    x = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    whisper.transcribe(x, context="kitchen light")
    # "no speech" is judged on a lone <|startoftranscript|>, then the prompt goes in on an empty cache
    assert [c.tolist() for c in rec.calls] == [[[whisper.sot]]]
    first = past.calls[0][0].tolist()
    context = whisper.context_ids("kitchen light")
    assert first[: len(context) + 4] == context + whisper.prompt("en")


def test_streams_with_other_contexts_in_one_step_each_get_what_they_get_alone(whisper):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(24000).astype(np.float32) * 0.1
    contexts = ["", "kitchen light", "set a timer for ten minutes in the living room"]
    alone = [whisper.transcribe(x, context=c).token_ids for c in contexts]
    streams = []
    for c in contexts:
        s = whisper.new_stream()
        s.context = whisper.context_ids(c)
        s.add_audio(x)
        s.end()
        streams.append(s)
    finals = whisper.step(streams)
    assert [h.token_ids for h in finals] == alone
    assert all(h.final for h in finals)


# -- the service ------------------------------------------------------------------------------


class _Engine:
    """A recogniser that records the context each of its streams was given, and hears "ok" when ended."""

    name, kind, sample_rate, max_utterance_s = "fake", "fake", 16000, 30.0

    def __init__(self) -> None:
        self.contexts: list[str] = []

    def context_ids(self, text: str) -> list[int]:
        self.contexts.append(text)
        return [len(text)]

    def new_stream(self):
        from edge_agent.models.recognizer import AudioStream

        return AudioStream(16000)

    def step(self, streams):
        from edge_agent.models.recognizer import Hypothesis

        out = []
        for s in streams:
            _, ended = s.take()
            out.append(Hypothesis("turn on the kitchen light" if ended else "turn", (), ended, "", 1.0))
        return out

    def close(self):
        pass


def _utterance(stream) -> None:
    stream.feed(np.full(16000, 0.3, np.float32))  # one second of "speech" (energy VAD)
    stream.feed(np.zeros(16000, np.float32))  # then a second of silence ends it
    stream.wait_steps(10.0)


def test_the_service_gives_each_new_utterance_the_operator_words_tools_and_last_final():
    from edge_agent.audio.vad import EndpointConfig
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService

    engine = _Engine()
    svc = AsrService(
        engine,
        limits=BatchLimits(max_batch=1, batch_timeout_ms=0),
        endpoint=EndpointConfig(60, 300, 100),
        chunk_ms=100,
    )
    svc.prompt_words = ("Anna",)
    svc.start()
    try:
        st = svc.open_stream()
        assert st.context == "Anna"
        st.set_context(HOME_TOOLS)
        _utterance(st)
        _utterance(st)
        st.close()
        assert st.wait(10.0)
    finally:
        svc.stop()
    assert len(st.finals) == 2
    first, second = engine.contexts[0], engine.contexts[-1]
    assert first == build_prompt(HOME_TOOLS, ["Anna"])
    assert second == build_prompt(HOME_TOOLS, ["Anna"], ["turn on the kitchen light"])


def test_tool_context_off_keeps_only_the_operator_words():
    from edge_agent.serving.asr.service import AsrService

    svc = AsrService(_Engine())
    svc.prompt_words, svc.tool_context = ("Anna",), False
    st = svc.open_stream(vad=False)
    st.set_context(HOME_TOOLS)
    assert st.context == "Anna"


# -- drafts: the last partial's tokens verified in one decoder call ------------------------------


def _greedy_setup(whisper, seed: int):
    x = np.random.default_rng(seed).standard_normal(20000).astype(np.float32) * 0.1
    hidden = whisper.encode([x])
    prompt = whisper.prompt("en")
    plain = whisper.decode(hidden, [prompt], [[]], [24])[0]
    return hidden, prompt, plain


def test_a_draft_changes_nothing_but_the_number_of_decoder_steps(whisper, monkeypatch):
    hidden, prompt, plain = _greedy_setup(whisper, 2)
    assert len(plain) >= 3
    wrong = [*plain[:2], (plain[2] + 1) % whisper.eot, *plain[3:]]
    for draft in (plain, plain[:1], wrong, [*plain, 7, 8, 9], [5, 6], []):
        assert whisper.decode(hidden, [prompt], [[]], [24], drafts=[draft])[0] == plain, draft
    forced = [11, 12]
    plain_forced = whisper.decode(hidden, [prompt], [forced], [24])[0]
    for draft in (plain_forced, [*forced, 3], [12, 11, 5]):  # the last one does not extend the forced tokens
        assert whisper.decode(hidden, [prompt], [forced], [24], drafts=[draft])[0] == plain_forced
    steps = _Recording(whisper.decoder_past)
    monkeypatch.setattr(whisper, "decoder_past", steps)
    whisper.decode(hidden, [prompt], [[]], [24], drafts=[plain])
    with_draft = len(steps.calls)
    whisper.decode(hidden, [prompt], [[]], [24])
    assert with_draft < len(steps.calls) - with_draft  # the whole draft kept: (almost) no steps left


def test_drafts_in_a_batch_give_each_row_its_plain_greedy_decode(whisper):
    x = np.random.default_rng(3).standard_normal(20000).astype(np.float32) * 0.1
    hidden = whisper.encode([x, x[::-1].copy()])
    prompts = [whisper.prompt("en")] * 2
    plain = whisper.decode(hidden, prompts, [[], []], [20, 20])
    out = whisper.decode(hidden, prompts, [[], []], [20, 20], drafts=[plain[0][:4], [1, 2, 3]])
    assert out == plain


def test_a_fork_carries_the_audio_context_and_last_tokens_and_decodes_as_a_fresh_stream(whisper):
    x = np.random.default_rng(4).standard_normal(24000).astype(np.float32) * 0.1
    s = whisper.new_stream()
    s.context = whisper.context_ids("kitchen")
    s.add_audio(x[:16000])
    whisper.step([s])  # a partial over the first second
    s.add_audio(x[16000:])  # pending, not yet taken
    twin = s.fork()
    assert twin.draft == s.last_ids and twin.context == s.context
    twin.end()
    (final,) = whisper.step([twin])
    assert final.final and final.token_ids == whisper.transcribe(x, context="kitchen").token_ids


# -- a final that writes out its context ------------------------------------------------------------

TOOLS_SAID = "Switch a room's light on or off, or dim it. Set a room's thermostat in degrees Celsius. kitchen, bedroom."


@pytest.mark.parametrize(
    ("text", "echo"),
    [
        ("Set the room's thermostat in degrees Celsius.", True),  # one word changed
        ("set a room's thermostat in degrees celsius", True),
        ("Switch a room's light on or off", True),
        ("Set the kitchen light on.", False),  # the context's words, not in its order
        ("turn on the bedroom light please", False),
        ("kitchen, bedroom.", False),  # too short to tell from a command naming two rooms
        ("", False),
    ],
)
def test_echoes_is_a_run_of_the_contexts_words_with_a_word_or_so_changed(text, echo):
    from edge_agent.models.asr_whisper import echoes

    assert echoes(text, TOOLS_SAID) is echo


def test_a_final_that_writes_out_its_context_is_heard_again_without_it(whisper, monkeypatch):
    """Whisper unsure of the audio may write out its prompt ("Set the room's thermostat in degrees Celsius."
    for "sing me a song"): that final is decoded again on the same encoder states with no context, and the
    streamed final gives what ``transcribe`` gives. A final that is not its context is left alone."""
    real = whisper.decode
    heard = whisper.tokenizer.encode(" Sing me a song.", add_special_tokens=False).ids
    calls = []

    def decode(hidden, prompts, forced, max_new, **kw):
        calls.append([list(p) for p in prompts])
        out = real(hidden, prompts, forced, max_new, **kw)
        for r, p in enumerate(prompts):
            if p[0] == whisper.prev:  # with a context: the model "writes it out", one word changed
                out[r] = whisper.tokenizer.encode(" Set the room's thermostat", add_special_tokens=False).ids
                out[r] += whisper.tokenizer.encode(" in degrees Celsius.", add_special_tokens=False).ids
            elif not forced[r]:
                out[r] = list(heard)
        return out

    monkeypatch.setattr(whisper, "decode", decode)
    x = np.random.default_rng(2).standard_normal(24000).astype(np.float32) * 0.1
    one = whisper.transcribe(x, context=TOOLS_SAID)
    assert one.text == "Sing me a song." and list(one.token_ids) == heard
    assert calls[-1] == [whisper.prompt("en")]  # heard again with no context
    s = whisper.new_stream()
    s.context = whisper.context_ids(TOOLS_SAID)
    s.add_audio(x)
    s.end()
    (final,) = whisper.step([s])
    assert final.final and final.text == one.text
    calls.clear()
    kept = whisper.transcribe(x, context="kitchen, bedroom")  # its text is not this context's words: kept
    assert kept.text == "Set the room's thermostat in degrees Celsius."
    assert len(calls) == 1 and calls[0][0][0] == whisper.prev
