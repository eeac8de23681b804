"""The home commands the demo and ``bench voice`` judge against, and the adapter's training generator.

- ``judge``: the same tool and exactly the same arguments, numbers by value; no call only where none is due.
- The held-out sets are held out: no sentence of theirs is one the training generator
  (``scripts/home_commands.py``) produces, over far more draws than a training run takes.
- The generator's numbers in words are English (checked against written-out expectations), and each
  call it pairs with a command is valid for its tool's schema.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

import pytest

from edge_agent.demo_models.home_commands import DEMO, DEV, HELD_OUT, UNSEEN, heat, judge, light, timer

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _generator():
    spec = importlib.util.spec_from_file_location("home_commands_gen", ROOT / "scripts" / "home_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("expected", "call", "right"),
    [
        (light("kitchen", True), light("kitchen", True), True),
        (light("kitchen", True), light("kitchen", False), False),
        (light("kitchen", True), light("bedroom", True), False),
        (light("hallway", True, brightness=30), light("hallway", True), False),
        (heat("bedroom", 21), heat("bedroom", 21.0), True),
        (heat("bedroom", 21), heat("bedroom", 21.5), False),
        (timer(5), timer(5, "tea"), False),
        (timer(5), {"name": "set_timer", "arguments": {"minutes": True}}, False),  # a boolean is no number
        (timer(1), {"name": "set_timer", "arguments": {"minutes": True}}, False),
        (timer(5), {"name": "set_light", "arguments": {"minutes": 5}}, False),
        (None, None, True),
        (None, timer(5), False),
        (timer(5), None, False),
    ],
)
def test_judge(expected, call, right):
    assert judge(expected, call) is right


def test_the_held_out_sentences_are_never_generated_for_training():
    gen = _generator()
    made = {text for seed in range(2) for text, _ in gen.examples(random.Random(seed), 8_000)}
    assert len(made) > 1000  # the templates' combinations, well covered
    assert not made & {c.text for c in (*HELD_OUT, *UNSEEN)}
    assert {c.text for c in DEMO} & made  # the demo's own commands are in the training distribution
    labels = {c.call["arguments"]["label"] for c in (*HELD_OUT, *UNSEEN) if c.call and "label" in c.call["arguments"]}
    assert len(labels) == 3
    pairs = [pair for seed in range(2) for pair in gen.examples(random.Random(seed), 8_000)]
    trained = {call["arguments"].get("label") for _, call in pairs if call}
    assert len(trained) > 40 and not labels & trained  # labels are copied from what was said, not picked


def test_some_generated_commands_are_written_as_a_recogniser_writes_them():
    pairs = _generator().examples(random.Random(3), 2_000)
    calls = [text for text, call in pairs if call is not None]
    assert 0.1 < sum("," in t for t in calls) / len(calls) < 0.3
    assert all(text == text.lower() and not text.endswith((".", "?", "!")) for text in calls)


@pytest.mark.parametrize(
    ("n", "said"),
    [(0, "zero"), (7, "seven"), (13, "thirteen"), (20, "twenty"), (21, "twenty one"), (45, "forty five"),
     (90, "ninety"), (100, "one hundred"), (105, "one hundred and five"), (240, "two hundred and forty")],
)  # fmt: skip
def test_numbers_in_words(n, said):
    assert _generator().words(n) == said


def test_generated_calls_follow_their_tools_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    from edge_agent.models.grammar import tool_call_schema

    tools = json.loads((ROOT / "edge_agent" / "demo_models" / "home-tools.json").read_text())["tools"]
    validator = jsonschema.Draft202012Validator(tool_call_schema(tools))
    pairs = _generator().examples(random.Random(1), 600)
    assert sum(call is None for _, call in pairs) > 40
    for _text, call in pairs:
        if call is not None:
            validator.validate(call)
    for command in (*DEMO, *DEV, *HELD_OUT):
        if command.call is not None:
            validator.validate(command.call)
