"""A recogniser's sentence reaches a voice turn with tools as a spoken command is written; without tools
(a plain question) the words go as they were heard."""

from __future__ import annotations

from edge_agent.serving.doors.voice.turn import VoiceTurn, spoken_command


def test_case_closing_punctuation_and_percent():
    assert spoken_command("Turn the bathroom lights down to 20%.") == "turn the bathroom lights down to 20 percent"
    assert spoken_command("  What time is it?  ") == "what time is it"
    assert spoken_command("Set a timer, please...") == "set a timer, please"
    assert spoken_command("") == "" and spoken_command("?!") == ""


def test_only_tool_turns_rewrite_the_words():
    tools = [{"type": "function", "function": {"name": "set_timer", "parameters": {"type": "object"}}}]
    with_tools = VoiceTurn(lambda *a, **k: None, tools, prefill_ahead=False, tick_s=None)
    plain = VoiceTurn(lambda *a, **k: None, None, prefill_ahead=False, tick_s=None)
    try:
        assert "dim it to 30 percent" in with_tools.chat("Dim it to 30%.")[-1].content
        assert plain.chat("Dim it to 30%.")[-1].content == "Dim it to 30%."
    finally:
        with_tools.close()
        plain.close()
