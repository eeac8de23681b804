"""The voice turn's whole-command check: every required parameter of some tool has a value in the words.
Tool sets: the shipped home tools and others (free strings, no required parameters, numbers as digits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.serving.doors.voice.command_check import command_check, names_a_command

HOME = json.loads((Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models" / "home-tools.json").read_text())[
    "tools"
]


@pytest.mark.parametrize(
    "text",
    [
        "turn on the kitchen lights",
        "switch off the living room light",
        "set a timer for ten minutes",
        "start a timer for 25 minutes",
        "make the kitchen twenty degrees",
        "set the bedroom temperature to twenty one degrees",
        "Turn the BEDROOM light on.",
    ],
)
def test_whole_home_commands(text):
    assert names_a_command(text, HOME)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "turn on the",  # no room
        "switch off the living",  # "living room" only in part
        "set a timer for",  # no number
        "make the kitchen",  # a room, but no temperature and no on/off
        "what time is it",
    ],
)
def test_not_yet_whole(text):
    assert not names_a_command(text, HOME)


def test_tools_whose_required_values_cannot_be_heard_cannot_tell():
    """A free string, or no required parameter at all, would make every utterance whole: the check says
    None (cannot tell), and True only for a tool with a required value heard in the words."""
    music = {
        "type": "function",
        "function": {
            "name": "play",
            "parameters": {
                "type": "object",
                "properties": {"artist": {"type": "string"}, "volume": {"type": "integer"}},
                "required": ["artist"],
            },
        },
    }
    stop = {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}}}
    assert names_a_command("play something by anyone", [music]) is None
    assert names_a_command("stop", [stop]) is None
    assert names_a_command("turn on the", [*HOME, stop]) is None  # not whole for the home tools
    assert names_a_command("turn on the kitchen lights", [*HOME, stop]) is True
    assert names_a_command("", [stop]) is False
    assert command_check(None) is None and command_check([]) is None
    check = command_check(HOME)
    assert check is not None and check("turn off the hallway light") is True and check("turn off the") is False
