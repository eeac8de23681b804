"""Voice-assistant sentences for training and evaluating the demo speech model.

Sentences come from templates over a closed vocabulary of a few hundred words: digits and
numbers, times and dates, device commands, timers, media, messages and short questions. Numbers
are always written as words ("forty percent", "seven thirty"), the form espeak-ng speaks and the
form ``edge_agent.metrics.wer.normalize`` turns digits into.

Every sentence belongs to one split by a hash of its text: a held-out sentence never occurs in
training, whatever the seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from edge_agent.metrics.wer import ONES, TENS, number_words  # the scorer normalises numbers the same way

ORDINALS = [
    "zeroth",
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
]
ROOMS = [
    "kitchen",
    "bedroom",
    "living room",
    "bathroom",
    "office",
    "garage",
    "hallway",
    "dining room",
    "basement",
    "garden",
    "kids room",
    "guest room",
    "porch",
    "attic",
    "laundry room",
]
LIGHTS = ["light", "lights", "lamp", "ceiling light", "desk lamp", "floor lamp"]
COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "white", "warm white", "cool white"]
APPLIANCES = [
    "fan",
    "heater",
    "air conditioner",
    "dishwasher",
    "washing machine",
    "dryer",
    "oven",
    "coffee maker",
    "television",
    "radio",
    "vacuum cleaner",
    "kettle",
    "humidifier",
    "speaker",
    "sprinkler",
]
DOORS = ["front door", "back door", "garage door", "side gate", "window", "blinds", "curtains"]
CITIES = [
    "london",
    "paris",
    "berlin",
    "tokyo",
    "new york",
    "chicago",
    "boston",
    "madrid",
    "rome",
    "sydney",
    "toronto",
    "dublin",
    "seattle",
    "denver",
    "miami",
    "vienna",
    "oslo",
    "cairo",
    "delhi",
    "lisbon",
]
NAMES = [
    "mom",
    "dad",
    "anna",
    "peter",
    "john",
    "mary",
    "david",
    "sarah",
    "michael",
    "emma",
    "james",
    "lucy",
    "robert",
    "olivia",
    "thomas",
    "grandma",
    "grandpa",
    "the office",
    "doctor smith",
    "alex",
]
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
DAYS = ["today", "tomorrow", "tonight", "this morning", "this afternoon", "this evening", "this weekend", "next week"]
GENRES = ["jazz", "rock", "classical", "pop", "country", "relaxing", "dance", "piano", "blues", "folk"]
ITEMS = [
    "milk",
    "bread",
    "eggs",
    "butter",
    "cheese",
    "apples",
    "bananas",
    "coffee",
    "tea",
    "rice",
    "pasta",
    "tomatoes",
    "potatoes",
    "chicken",
    "orange juice",
    "soap",
    "paper towels",
    "batteries",
    "sugar",
    "yogurt",
]
TASKS = [
    "call the dentist",
    "take the medicine",
    "water the plants",
    "feed the cat",
    "walk the dog",
    "pick up the kids",
    "buy a gift",
    "pay the bills",
    "check the mail",
    "take out the trash",
    "start dinner",
    "charge the car",
    "book a table",
    "send the report",
]
UNITS = ["minutes", "hours", "seconds", "days", "weeks"]
CONVERT = [
    ("cups", "liter"),
    ("ounces", "pound"),
    ("inches", "foot"),
    ("feet", "mile"),
    ("grams", "kilogram"),
    ("minutes", "day"),
    ("seconds", "hour"),
    ("days", "year"),
    ("meters", "kilometer"),
]
OPS = ["plus", "minus", "times", "divided by"]
POLITE = ["", "", "", "please ", "hey computer ", "okay ", "can you ", "could you please "]


def ordinal_words(n: int) -> str:
    """1 <= n <= 31 as an ordinal: 23 -> "twenty third"."""
    if n <= 20:
        return ORDINALS[n]
    if n % 10 == 0:
        return TENS[n // 10][:-1] + "ieth"
    return TENS[n // 10] + " " + ORDINALS[n % 10]


def _time(r: random.Random) -> str:
    hour = r.randint(1, 12)
    minute = r.choice([0, 0, 5, 10, 15, 20, 25, 30, 30, 40, 45, 50, r.randint(1, 59)])
    if minute == 0:
        text = f"{ONES[hour] if hour < 20 else number_words(hour)} o'clock" if r.random() < 0.5 else number_words(hour)
    elif minute < 10:
        text = f"{number_words(hour)} oh {ONES[minute]}"
    else:
        text = f"{number_words(hour)} {number_words(minute)}"
    suffix = r.choice(["", "", "", " in the morning", " in the afternoon", " in the evening", " at night"])
    return text + suffix


def _date(r: random.Random) -> str:
    month, day = r.choice(MONTHS), ordinal_words(r.randint(1, 28))
    return r.choice([f"{month} {day}", f"the {day} of {month}", f"{r.choice(WEEKDAYS)} {month} {day}"])


def _pct(r: random.Random) -> str:
    return number_words(r.choice([r.randint(1, 100), r.randrange(10, 101, 10), r.randrange(5, 100, 5)]))


def _digits(r: random.Random, n: int) -> str:
    return " ".join(ONES[r.randint(0, 9)] for _ in range(n))


def _room(r: random.Random) -> str:
    return r.choice(ROOMS)


_TEMPLATES: list[Callable[[random.Random], str]] = [
    lambda r: f"turn {r.choice(['on', 'off'])} the {_room(r)} {r.choice(LIGHTS)}",
    lambda r: f"switch {r.choice(['on', 'off'])} the {r.choice(LIGHTS)} in the {_room(r)}",
    lambda r: f"set the {_room(r)} {r.choice(LIGHTS)} to {_pct(r)} percent",
    lambda r: f"dim the {_room(r)} {r.choice(LIGHTS)} to {_pct(r)} percent",
    lambda r: f"make the {_room(r)} {r.choice(LIGHTS)} {r.choice(COLORS)}",
    lambda r: f"change the {r.choice(LIGHTS)} to {r.choice(COLORS)}",
    lambda r: f"set the temperature to {number_words(r.randint(15, 30))} degrees",
    lambda r: f"set the {_room(r)} thermostat to {number_words(r.randint(55, 80))}",
    lambda r: f"{r.choice(['raise', 'lower'])} the temperature by {number_words(r.randint(1, 5))} degrees",
    lambda r: f"what is the temperature in the {_room(r)}",
    lambda r: f"set a timer for {number_words(r.randint(1, 90))} {r.choice(['minutes', 'seconds', 'hours'])}",
    lambda r: f"cancel the {number_words(r.randint(2, 60))} minute timer",
    lambda r: "how much time is left on the timer",
    lambda r: f"set an alarm for {_time(r)}",
    lambda r: f"wake me up at {_time(r)} {r.choice(['tomorrow', 'on ' + r.choice(WEEKDAYS), ''])}".strip(),
    lambda r: f"remind me to {r.choice(TASKS)} at {_time(r)}",
    lambda r: f"remind me to {r.choice(TASKS)} on {r.choice(WEEKDAYS)}",
    lambda r: f"remind me to {r.choice(TASKS)} {r.choice(DAYS)}",
    lambda r: f"schedule a meeting with {r.choice(NAMES)} on {_date(r)} at {_time(r)}",
    lambda r: f"what is on my calendar {r.choice(DAYS + ['on ' + d for d in WEEKDAYS])}",
    lambda r: f"what time is it in {r.choice(CITIES)}",
    lambda r: f"what is the date {r.choice(['today', 'tomorrow', 'next ' + r.choice(WEEKDAYS)])}",
    lambda r: f"what day is {_date(r)}",
    lambda r: f"how many days until {_date(r)}",
    lambda r: f"what is the weather {r.choice(['like ', ''])}in {r.choice(CITIES)} {r.choice(DAYS)}",
    lambda r: f"will it rain {r.choice(DAYS)}",
    lambda r: f"do i need an umbrella {r.choice(DAYS)}",
    lambda r: f"play {r.choice(GENRES)} music in the {_room(r)}",
    lambda r: f"play some {r.choice(GENRES)} music",
    lambda r: f"set the volume to {number_words(r.randint(0, 10))}",
    lambda r: f"set the volume to {_pct(r)} percent",
    lambda r: f"turn the volume {r.choice(['up', 'down'])}",
    lambda r: r.choice(
        [
            "pause the music",
            "skip this song",
            "play the next song",
            "stop the music",
            "play the previous song",
            "resume playback",
            "what song is this",
            "shuffle my playlist",
        ]
    ),
    lambda r: f"{r.choice(['lock', 'unlock', 'open', 'close'])} the {r.choice(DOORS)}",
    lambda r: f"is the {r.choice(DOORS)} {r.choice(['locked', 'open', 'closed'])}",
    lambda r: f"turn {r.choice(['on', 'off'])} the {r.choice(APPLIANCES)}",
    lambda r: f"start the {r.choice(APPLIANCES)} in {number_words(r.randint(1, 60))} minutes",
    lambda r: f"turn off the {r.choice(APPLIANCES)} at {_time(r)}",
    lambda r: f"set the {r.choice(APPLIANCES)} to level {number_words(r.randint(1, 10))}",
    lambda r: f"call {r.choice(NAMES)}",
    lambda r: f"call {r.choice(NAMES)} on {r.choice(['speaker', 'video', 'the mobile'])}",
    lambda r: f"dial {_digits(r, r.choice([3, 4, 7, 10]))}",
    lambda r: f"send a message to {r.choice(NAMES)} saying i will be there at {_time(r)}",
    lambda r: f"text {r.choice(NAMES)} that i am running {number_words(r.randint(2, 30))} minutes late",
    lambda r: f"add {r.choice(ITEMS)} to the shopping list",
    lambda r: f"add {number_words(r.randint(2, 12))} {r.choice(ITEMS)} to my list",
    lambda r: f"remove {r.choice(ITEMS)} from the shopping list",
    lambda r: f"what is {number_words(r.randint(0, 99))} {r.choice(OPS)} {number_words(r.randint(1, 99))}",
    lambda r: "how many {} are in a {}".format(*r.choice(CONVERT)),
    lambda r: (
        f"convert {number_words(r.randint(1, 100))} {r.choice(['miles', 'pounds', 'degrees', 'inches'])} "
        f"to {r.choice(['kilometers', 'kilograms', 'celsius', 'centimeters'])}"
    ),
    lambda r: f"my code is {_digits(r, r.choice([4, 5, 6]))}",
    lambda r: f"the number is {number_words(r.randint(0, 9999))}",
    lambda r: f"it costs {number_words(r.randint(1, 999))} dollars",
    lambda r: f"the year {number_words(r.randint(1990, 2030))}",
    lambda r: f"how long does it take to get to {r.choice(CITIES)}",
    lambda r: f"how far is {r.choice(CITIES)} from {r.choice(CITIES)}",
    lambda r: r.choice(
        [
            "what can you do",
            "tell me a joke",
            "good morning",
            "good night",
            "thank you",
            "stop",
            "cancel that",
            "never mind",
            "what did you say",
            "repeat that please",
            "help",
            "turn everything off",
            "i am leaving now",
            "i am home",
            "start the morning routine",
            "start the night routine",
            "is anyone at the door",
            "where is my phone",
            "read my messages",
            "what is the news today",
            "show me the front camera",
        ]
    ),
]


def sentence(r: random.Random) -> str:
    text = r.choice(_TEMPLATES)(r)
    if r.random() < 0.35:
        text = r.choice(POLITE) + text
    return " ".join(text.split())


def split_of(text: str) -> str:
    """``"heldout"`` for about one sentence in eight (by a hash of the text), else ``"train"``."""
    digest = hashlib.sha256(text.encode()).digest()
    return "heldout" if digest[0] % 8 == 0 else "train"


def sentences(split: str, count: int, seed: int) -> list[str]:
    """``count`` sentences of ``split``, deterministic for a seed (repeats allowed: templates are finite)."""
    r = random.Random(f"{split}:{seed}")
    out: list[str] = []
    while len(out) < count:
        text = sentence(r)
        if split_of(text) == split:
            out.append(text)
    return out


def unique_sentences(split: str, count: int, seed: int) -> list[str]:
    """Like ``sentences`` but without repeats (for evaluation sets)."""
    r = random.Random(f"{split}:unique:{seed}")
    seen: dict[str, None] = {}
    while len(seen) < count:
        text = sentence(r)
        if split_of(text) == split:
            seen.setdefault(text)
    return list(seen)


def vocabulary() -> list[str]:
    """Every word the templates can produce (for the lexicon), sorted."""
    r = random.Random(0)
    words: set[str] = set()
    for _ in range(200_000):
        words.update(sentence(r).split())
    return sorted(words)


if __name__ == "__main__":
    words = vocabulary()
    print(len(words), "words")
    for s in sentences("train", 10, 0):
        print(s)
