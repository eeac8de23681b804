"""Synthetic home commands for the home-commands adapter of Gemma 3 270M (scripts/train-home-lora).

Commands come from templates (three tools, rooms, on/off, brightness, minutes, degrees, labels,
numbers as words or digits, polite and terse forms) plus requests no tool answers (questions,
chit-chat, other languages, word salad, commands cut short), each paired with its call, or with
``NO_ACTION`` text. Every prompt is what the agent itself sends for a voice turn: the user's words with
the home tools described in front (``serving.doors.openai.output.with_tools``), rendered by the model's chat
template (``Tokenizer.encode_chat``), for both ``tool_choice`` modes. The tools' part is the same for every
command, so it is written once per mode as ``prefix``; each example holds only what follows it.

    .venv/bin/python scripts/home_commands.py --model DIR --out data.jsonl [--count 3200] [--seed 7]

Output: one JSON object per line: the first lines ``{"prefix": [...], "mode": "auto"|"required"}``,
then ``{"mode", "text", "suffix": [...], "target": [...]}`` (token ids; ``target`` ends with the end-of-turn
id), then ``{"mode": "text", "ids": [...]}``: windows of plain English text (BOS and ``--text-window``
tokens of ``--text``, after its first ``--text-skip`` tokens), for the trainer's language-model batches,
which keep the adapted model a language model (the adapter is for tool calls, not for running text).
The default text is the one the recipe's perplexity gate reads; the gate scores its first 4,096 tokens and
the INT4 build calibrates on the 3,072 after them, so the windows start after 8,192.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("kitchen", "living room", "bedroom", "bathroom", "hallway")
NO_ACTION = "Sorry, I cannot do that."  # short: a no-action reply is words, decoded a token at a time
ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
ONES += "seventeen eighteen nineteen"
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    """An integer 0..999 in English words (``twenty one``, ``one hundred and five``)."""
    ones = ONES.split()
    if n < 20:
        return ones[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ones[n % 10])
    rest = n % 100
    return ones[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))


def number(rng: random.Random, n: int) -> str:
    return str(n) if rng.random() < 0.25 else words(n)


def light(room: str, on: bool, **extra: int) -> dict:
    return {"name": "set_light", "arguments": {"room": room, "on": on, **extra}}


LIGHT_ON = (
    "turn on the {room} light",
    "turn on the {room} lights",
    "switch on the {room} light",
    "turn the {room} light on",
    "switch the {room} lights on",
    "{room} light on",
    "lights on in the {room}",
    "put the {room} light on",
    "can you turn on the light in the {room}",
    "please switch on the {room} lights",
    "{room} lights on please",
    "{room} lamp on",
    "could you please light up the {room}",
    "i want the {room} light on",
    "i would like the lights on in the {room}",
    "make the {room} bright",
    "power on the {room} lamp",
)
LIGHT_OFF = (
    "turn off the {room} light",
    "turn off the {room} lights",
    "switch off the {room} light",
    "turn the {room} light off",
    "switch the {room} lights off",
    "{room} light off",
    "lights off in the {room}",
    "can you turn off the light in the {room}",
    "please switch off the {room} lights",
    "shut off the {room} light",
    "{room} lamp off please",
    "kill the lights in the {room}",
    "cut the {room} light",
    "lights out in the {room}",
    "make the {room} dark",
    "i want the {room} light off",
    "power off the {room} lamp",
)
DIM = (
    "dim the {room} light to {n} percent",
    "set the {room} light to {n} percent",
    "set the {room} lights to {n} percent brightness",
    "{room} light at {n} percent",
    "turn the {room} light to {n} percent",
    "brightness {n} percent in the {room}",
    "i want the {room} lamp at {n} percent",
    "{room} lights to {n} percent please",
)
TIMER = (
    "set a timer for {n} minutes",
    "start a timer for {n} minutes",
    "timer for {n} minutes",
    "start a {n} minute timer",
    "set a {n} minute timer",
    "can you set a timer for {n} minutes",
    "timer {n} minutes",
    "remind me in {n} minutes",
    "count down {n} minutes",
    "wake me in {n} minutes",
    "alarm in {n} minutes",
    "i need a timer for {n} minutes",
)
TIMER_LABEL = (
    "set a timer for {n} minutes for the {label}",
    "start a {n} minute timer for the {label}",
    "{label} timer {n} minutes",
    "set a {label} timer for {n} minutes",
    "i need a {n} minute timer for the {label}",
    "remind me about the {label} in {n} minutes",
    "set a timer called {label} for {n} minutes",
    "timer for the {label} {n} minutes",
    "{n} minute {label} timer",
    "start the {label} timer for {n} minutes",
    "alarm in {n} minutes for the {label}",
    "{n} minutes on the {label} timer",
)
# Labels are any household word the user says: the adapter must copy it, not pick from a list (the held-out
# sets' labels are none of these; tests/unit/test_home_commands.py checks that).
LABELS = (
    "pasta", "tea", "oven", "rice", "pizza", "bread", "washing", "nap", "cake", "soup", "kids", "bus",
    "eggs", "coffee", "dishwasher", "roast", "chicken", "muffins", "homework", "meeting", "call", "plants",
    "dryer", "car", "noodles", "beans", "fish", "steak", "pie", "dough", "yoga", "workout", "medicine",
    "dog", "baby", "stew", "porridge", "vegetables", "sauce", "tart", "bath", "game", "break", "train",
    "shower", "popcorn", "lasagna", "curry", "salmon", "cleaning", "reading", "piano", "guests", "sprinkler",
)  # fmt: skip
# Transcripts: a recogniser writes commas and fillers people say ("okay, turn on ..."): some commands get them
FILLERS = ("okay", "hey", "please", "so", "um", "alright", "now")
TAILS = ("please", "thanks", "thank you", "now", "right now")


def spoken_style(rng: random.Random, text: str) -> str:
    """``text`` as a recogniser may write it: a filler before it or a tail after it, often with a comma."""
    r = rng.random()
    if r < 0.12:
        return f"{rng.choice(FILLERS)}{',' if rng.random() < 0.6 else ''} {text}"
    if r < 0.22 and not text.endswith(TAILS):
        return f"{text}{',' if rng.random() < 0.6 else ''} {rng.choice(TAILS)}"
    return text


HOURS = (("an hour", 60), ("half an hour", 30), ("two hours", 120), ("one hour", 60), ("three hours", 180))
TEMP = (
    "set the {room} temperature to {n} degrees",
    "set the {room} to {n} degrees",
    "make the {room} {n} degrees",
    "set the thermostat in the {room} to {n}",
    "change the {room} temperature to {n} degrees",
    "heat the {room} to {n} degrees",
    "{room} temperature {n} degrees",
    "can you set the {room} to {n} degrees please",
    "warm the {room} up to {n} degrees",
    "cool the {room} down to {n} degrees",
    "bring the {room} to {n} degrees",
    "i would like the {room} at {n} degrees",
    "{n} degrees in the {room}",
)
NONE = (
    "what time is it",
    "what is the time",
    "what day is it today",
    "what is the weather like",
    "will it rain today",
    "who are you",
    "how are you",
    "what is your name",
    "play some music",
    "call my mother",
    "order a pizza",
    "what is two plus two",
    "tell me a story",
    "good morning",
    "thank you",
    "lock the front door",
    "open the garage",
    "what is the capital of france",
    "how tall is mount everest",
    "quel temps fait il",
    "allume la lumiere",
    "wie spat ist es",
    "mach das licht an",
    "enciende la luz",
    "blue window seven cat",
    "banana under the quickly",
    "the the the",
    "hmm",
    "turn on the",
    "set a timer",
    "set the temperature",
    "switch off",
    "what is the news",
    "how old are you",
    "send a message to tom",
    "buy some milk",
    "wo ist der bahnhof",
    "gracias",
)


def examples(rng: random.Random, count: int) -> list[tuple[str, dict | None]]:
    """``count`` (text, call or None) pairs, about 80 % calls, some in a transcript's style (``spoken_style``)."""
    return [(spoken_style(rng, text) if call is not None else text, call) for text, call in _plain(rng, count)]


def _plain(rng: random.Random, count: int) -> list[tuple[str, dict | None]]:
    out: list[tuple[str, dict | None]] = []
    while len(out) < count:
        kind = rng.random()
        room = rng.choice(ROOMS)
        if kind < 0.17:
            out.append((rng.choice(LIGHT_ON).format(room=room), light(room, True)))
        elif kind < 0.34:
            out.append((rng.choice(LIGHT_OFF).format(room=room), light(room, False)))
        elif kind < 0.44:
            n = rng.choice(range(5, 101, 5))
            out.append((rng.choice(DIM).format(room=room, n=number(rng, n)), light(room, True, brightness=n)))
        elif kind < 0.62:
            if rng.random() < 0.15:
                said, n = rng.choice(HOURS)
                text = rng.choice(("set a timer for {h}", "start a timer for {h}", "timer {h}")).format(h=said)
                out.append((text, {"name": "set_timer", "arguments": {"minutes": n}}))
                continue
            n = rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 75, 90))
            said = number(rng, n)
            if rng.random() < 0.3:
                label = rng.choice(LABELS)
                text = rng.choice(TIMER_LABEL).format(n=said, label=label)
                args: dict = {"minutes": n, "label": label}
            else:
                text, args = rng.choice(TIMER).format(n=said), {"minutes": n}
            if n == 1:
                text = text.replace("minutes", "minute")
            out.append((text, {"name": "set_timer", "arguments": args}))
        elif kind < 0.82:
            n = rng.randint(12, 28)
            text = rng.choice(TEMP).format(room=room, n=number(rng, n))
            out.append((text, {"name": "set_temperature", "arguments": {"room": room, "celsius": n}}))
        else:
            out.append((rng.choice(NONE), None))
    return out


def main() -> None:
    from edge_agent.models.catalog import inspect_folder
    from edge_agent.models.perplexity import text_tokens
    from edge_agent.models.tokenizer import Message, Tokenizer
    from edge_agent.serving.doors.openai.output import with_tools

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the imported Gemma 3 folder (its tokenizer and chat template)")
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=3200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--text", type=Path, default=ROOT / "calibration/llm/text/python-reference.txt")
    p.add_argument("--text-skip", type=int, default=8192, help="tokens of --text left out first")
    p.add_argument("--text-window", type=int, default=96, help="tokens per plain-text window")
    args = p.parse_args()
    ref = inspect_folder(Path(args.model))
    tok = Tokenizer(ref.path, ref.model_type)
    tools = json.loads((ROOT / "edge_agent/demo_models/home-tools.json").read_text())
    end = tok.encode("<end_of_turn>", add_special_tokens=False)
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        prefixes = {}
        for mode in ("auto", "required"):

            def render(text: str, mode: str = mode) -> list[int]:
                return tok.encode_chat(with_tools([Message("user", text)], tools["tools"], mode))

            a, b = render("x y"), render("z w")
            n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            prefixes[mode] = a[:n]
            f.write(json.dumps({"mode": mode, "prefix": a[:n]}) + "\n")
        for text, call in examples(rng, args.count):
            mode = "auto" if call is None or rng.random() < 0.6 else "required"
            ids = tok.encode_chat(with_tools([Message("user", text)], tools["tools"], mode))
            assert ids[: len(prefixes[mode])] == prefixes[mode]
            reply = json.dumps(call) if call is not None else NO_ACTION
            target = tok.encode(reply, add_special_tokens=False) + end
            f.write(json.dumps({"mode": mode, "text": text, "suffix": ids[len(prefixes[mode]) :], "target": target}))
            f.write("\n")
        ids, bos = text_tokens(tok, args.text.read_text(encoding="utf-8"))
        w = args.text_window
        for start in range(args.text_skip, len(ids) - w + 1, w):
            f.write(json.dumps({"mode": "text", "ids": ([bos] if bos is not None else []) + ids[start : start + w]}))
            f.write("\n")


if __name__ == "__main__":
    main()
