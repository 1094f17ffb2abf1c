"""How users word their requests: a bank of surface forms per family, split into a training part and a held-out
part that training never sees.

A model trained on a handful of request templates learns the templates, not the tasks: the first demo model, trained
on 6-8 templates per family, answered about one request in four when it was worded otherwise. So requests are
composed here from interchangeable pieces (whole templates, order words, politeness, the way the data is written)
and every kind of piece is split in two. ``split="train"`` draws only training pieces; ``split="held_out"`` draws a
held-out template or phrase wherever one exists (politeness pieces held out too), so a held-out request is worded
in a way the model has not read. The forms that are not wording (lower case, a missing final stop, how numbers are
separated) are shared by both parts.

What is held out is sentences, not vocabulary: every word of a held-out addition, sort or reversal template is read
somewhere in that family's training pieces (tests/test_demo_tasks.py checks it). A model trained from scratch on this
corpus alone has no other source for what "flip", "rank" or "going down" mean, so a word it never read cannot be a
measure of how it generalises; the training pieces therefore carry the verbs and order words people use, and the
held-out templates put them into sentences training never had. Politeness and openers stay unread in both senses:
they carry no meaning, and the model must learn to pass over them.

`tasks.generate_examples(..., wording="train" | "held_out")` uses these; ``wording="templates"`` keeps the original
templates (the problems earlier results were measured on).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

SPLITS = ("train", "held_out")

# The one reply to requests outside the demo's families: short, fixed and honest instead of a guess.
OUT_OF_SCOPE_REPLY = (
    "I am a tiny demo model: I can add two numbers, sort numbers, reverse a list of words and call the demo tools."
)
OUT_OF_SCOPE_REASONING = "This is not a sum, a sort, a reversal or a tool request, so I say what I can do."


def _pick(rng: random.Random, bank: tuple[Sequence[str], Sequence[str]], split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}")
    return rng.choice(bank[SPLITS.index(split)])


# Politeness and openers around a request: (training, held out).
_PREFIXES = (
    ("", "", "", "", "", "Please ", "Hey, ", "Hi! ", "Quick question: ", "Can you help? ", "I need help. "),
    ("", "", "", "Hello! ", "Hey there, ", "Ok so ", "Real quick: ", "Good morning. "),
)
_SUFFIXES = (
    ("", "", "", "", "", " please", " Thanks!", " thank you", " :)", " Thanks in advance."),
    ("", "", "", " thx", " Cheers.", " if you can", " Much appreciated!", " ty"),
)


def _dress(rng: random.Random, request: str, split: str, lowercase_ok: bool = True) -> str:
    """Politeness around the request, then the forms any user may type: lower case, no final punctuation."""
    prefix, suffix = _pick(rng, _PREFIXES, split), _pick(rng, _SUFFIXES, split)
    if request.lower().startswith(prefix.strip(" ,!?.:").lower() or "\0"):  # no "Please please ..."
        prefix = ""
    if prefix.endswith((", ", "Please ", "so ")):
        request = request[:1].lower() + request[1:]
    text = prefix + request + suffix
    if lowercase_ok and rng.random() < 0.2:
        text = text.lower()
    if rng.random() < 0.2 and text[-1:] in ".?!":
        text = text[:-1]
    return text


# ---------------------------------------------------------------------------------------------------------------
# Addition

_ADDITION = (
    (
        "What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}.", "Please calculate the sum of {a} and {b}.",
        "{a} + {b} = ?", "What do you get if you add {a} and {b}?", "Work out {a} + {b}.", "Find the sum: {a} + {b}",
        "what's {a} plus {b}?", "{a} plus {b}?", "Sum {a} and {b}.", "What is the total of {a} and {b}?",
        "Can you add {a} and {b}?", "calculate {a}+{b}", "{a}+{b}", "{a} + {b}", "Give me the sum of {a} and {b}.",
        "Tell me what {a} + {b} makes.", "Add up {a} and {b}.", "If I add {a} and {b}, what do I get?",
        "Total of {a} and {b}?", "Could you work out {a} plus {b}?", "Sum: {a}, {b}", "what does {a} + {b} equal",
        "Help me add {a} and {b}.", "I have {a} and {b}. What is their sum?", "{a} and {b} added together?",
        "Calculate: {a} + {b}", "How much do {a} and {b} add up to?", "Find {a} plus {b}.",
        "{a} plus {b} equals?", "Combine {a} with {b}.", "Try adding {a} to {b}.", "Would you mind summing {a} and {b}?",
        "Get me {a} + {b}.", "What does {a} + {b} come to?", "Addition: {a} + {b}", "Do this sum: {a} + {b}.",
        "Add all of this up: {a} + {b}",
    ),
    (
        "What's {a} plus {b}, all together?", "What's the sum of {a} and {b}?", "{a} + {b} equals what?",
        "Combine {a} and {b}: what's the total?", "Mind adding {a} to {b}?", "Can I get {a} + {b}?",
        "What do {a} and {b} come to?", "Do the addition {a} + {b}.",
    ),
)  # fmt: skip


def addition_request(rng: random.Random, a: int, b: int, split: str) -> str:
    return _dress(rng, _pick(rng, _ADDITION, split).format(a=a, b=b), split)


# ---------------------------------------------------------------------------------------------------------------
# Sorting: a template with the numbers and an order phrase

_ASCENDING = (
    (
        "in ascending order",
        "in increasing order",
        "from smallest to largest",
        "from lowest to highest",
        "from low to high",
        "smallest first",
        "from least to greatest",
        "in order from small to large",
        "ascending",
        "with the smallest number first",
        "small ones first, big ones last",
        "counting up",
        "going from low to high",
        "least first, most last",
    ),
    ("from small to big", "lowest first", "from the smallest up", "least to most", "going up"),
)
_DESCENDING = (
    (
        "in descending order",
        "in decreasing order",
        "from largest to smallest",
        "from highest to lowest",
        "from high to low",
        "biggest first",
        "largest first",
        "from greatest to least",
        "descending",
        "with the largest number first",
        "big ones first, small ones last",
        "counting down",
        "going from high to low",
        "most first, least last",
    ),
    ("from big to small", "highest first", "from the biggest down", "most to least", "going down"),
)
_SORT = (
    (
        "Sort these numbers {order}: {nums}", "Sort {nums} {order}.", "Put these numbers {order}: {nums}",
        "Arrange {nums} {order}.", "{nums} - sort them {order}", "Order the following {order}: {nums}",
        "Can you sort {nums} {order}?", "Please put {nums} in order, {order}.", "Sort the list {nums} {order}",
        "I have these numbers: {nums}. Sort them {order}.", "Numbers: {nums}. Sort {order}.",
        "Sort {order}: {nums}", "Put {nums} in order {order}.", "Could you arrange these {order}? {nums}",
        "sort {nums} {order}", "Write {nums} {order}.", "Rank these numbers {order}: {nums}", "{nums}: list them {order}",
        "Rearrange these {order}: {nums}", "Give {nums} back {order}.", "Some numbers for you: {nums}. Sort them {order}.",
        "Here is a list: {nums}. Put it {order}.", "What are {nums} {order}?",
    ),
    (
        "Rank {nums} {order}.", "Could you order {nums} {order}?", "List {nums} {order}.",
        "Here are some numbers: {nums}. Give them back {order}.", "Rearrange the list {nums} {order}",
        "What is {nums} sorted {order}?",
    ),
)  # fmt: skip
# Without an order phrase a sort is ascending.
_SORT_PLAIN = (
    (
        "Please sort: {nums}",
        "Sort: {nums}",
        "sort these {nums}",
        "Sort the numbers {nums}.",
        "{nums} sorted?",
        "Line these up: {nums}",
        "Get these sorted: {nums}",
        "put {nums} into a sorted list",
    ),
    ("Line up {nums}.", "Get {nums} into order."),
)


def _join(rng: random.Random, items: Sequence[str]) -> str:
    """Items separated as people type lists: commas, spaces, or commas with "and" before the last."""
    style = rng.choice(("comma", "comma", "space", "and"))
    if style == "space":
        return " ".join(items)
    if style == "and" and len(items) > 1:
        return ", ".join(items[:-1]) + " and " + items[-1]
    return ", ".join(items)


def sorting_request(rng: random.Random, nums: Sequence[int], descending: bool, split: str) -> str:
    data = _join(rng, [str(n) for n in nums])
    if not descending and rng.random() < 0.15:
        return _dress(rng, _pick(rng, _SORT_PLAIN, split).format(nums=data), split)
    order = _pick(rng, _DESCENDING if descending else _ASCENDING, split)
    return _dress(rng, _pick(rng, _SORT, split).format(nums=data, order=order), split)


# ---------------------------------------------------------------------------------------------------------------
# Reversal

_REVERSAL = (
    (
        "Reverse the order of these words: {words}", "Write these words in reverse order: {words}",
        "Reverse this list of words: {words}", "Give me these words from last to first: {words}",
        "Please reverse: {words}", "Say these words backwards, last word first: {words}", "Reverse {words}.",
        "Write {words} backwards, word by word.", "Can you reverse the words {words}?",
        "Put these words in reverse order: {words}", "{words} - reverse that", "Backwards please: {words}",
        "Read {words} from the end.", "Words: {words}. Reverse them.", "Reverse the word order of {words}",
        "What is {words} in reverse order?", "reverse {words}", "Write {words} from the last word to the first.",
        "Flip {words}.", "flip these: {words}", "Turn it around: {words}", "Invert this list: {words}", "Mirror {words}.",
        "Opposite order please: {words}", "Could you reverse {words}?", "Write {words} starting with the last word.",
    ),
    (
        "Flip the order of {words}.", "Turn {words} around.", "Say {words} in the opposite order.",
        "Give me {words} starting from the end.", "Mirror the order: {words}", "Could you invert the order of {words}?",
    ),
)  # fmt: skip


def reversal_request(rng: random.Random, words: Sequence[str], split: str) -> str:
    quote = rng.choice(("", "", "", '"', "'"))
    data = quote + (_join(rng, words) if not quote else " ".join(words)) + quote
    return _dress(rng, _pick(rng, _REVERSAL, split).format(words=data), split)


# ---------------------------------------------------------------------------------------------------------------
# Tool calls: more ways to ask for each demo tool (the tool's own `requests` are training templates too)

TOOL_REQUESTS = {
    "get_weather": (
        (
            "Weather in {city}, {unit} please.", "how's the weather in {city}? ({unit})", "Is it warm in {city}? Answer in {unit}.",
            "{city} weather in {unit}", "What's it like outside in {city}? I use {unit}.",
        ),
        ("Forecast for {city} in {unit}?", "Any idea how cold it is in {city}? Give me {unit}."),
    ),
    "convert_currency": (
        (
            "{amount} {from_currency} to {to_currency}?", "Change {amount} {from_currency} to {to_currency}.",
            "How many {to_currency} is {amount} {from_currency}?", "convert {amount} {from_currency} into {to_currency}",
            "I have {amount} {from_currency}. What is that in {to_currency}?",
        ),
        ("Trade {amount} {from_currency} for {to_currency}.", "Exchange {amount} {from_currency} into {to_currency}."),
    ),
    "lookup_stock": (
        (
            "Price of {symbol}?", "What's {symbol} at?", "{symbol} stock price please", "Check the price of {symbol} shares.",
            "How much does one {symbol} share cost?",
        ),
        ("Where is {symbol} trading today?", "Quote {symbol} for me."),
    ),
    "set_timer": (
        (
            "Timer: {minutes} minutes, {label}.", "Set a {label} timer, {minutes} minutes.", "{minutes} minute timer for {label} please",
            "Remind me in {minutes} minutes with a timer named {label}.", "Can you start a timer of {minutes} minutes for {label}?",
        ),
        ("Count down {minutes} min, {label}.", "Could you time {minutes} minutes of {label}?"),
    ),
    "send_email": (
        (
            "Email {to} about {subject}.", "Send a mail to {to}, subject {subject}.", "Write an email to {to} titled {subject}.",
            "Drop {to} an email with the subject {subject}.", "Can you email {to}? Subject: {subject}",
        ),
        ("Shoot {to} an email, subject {subject}.", "Mail {to} with the title {subject}."),
    ),
    "get_time": (
        (
            "Time in {city}?", "What's the time in {city} now?", "What time is it right now in {city}?",
            "Local time {city}", "Do you know the time in {city}?",
        ),
        ("What hour is it in {city}?", "Clock check: {city}."),
    ),
    "get_distance": (
        (
            "Distance from {origin} to {destination}?", "How far apart are {origin} and {destination}?",
            "{origin} to {destination}: how far?", "How long is the trip from {origin} to {destination}?",
            "Get the distance between {origin} and {destination}.",
        ),
        ("How many km separate {origin} and {destination}?", "Is {destination} far from {origin}?"),
    ),
    "book_table": (
        (
            "Table for {people} at {restaurant}, please.", "Book {restaurant} for {people} people.",
            "Reserve {restaurant}, {people} guests.", "We are {people}. Get us a table at {restaurant}.",
            "Can you book a table at {restaurant} for {people}?",
        ),
        ("Grab us a table at {restaurant} for {people}.", "Make a reservation for {people} at {restaurant}."),
    ),
}  # fmt: skip


def tool_request(rng: random.Random, tool_name: str, own_templates: Sequence[str], args: dict, split: str) -> str:
    train, held_out = TOOL_REQUESTS[tool_name]
    bank = ((*own_templates, *train), held_out)
    # Tool arguments (city names, symbols) keep their case: the call must pass them as written.
    return _dress(rng, _pick(rng, bank, split).format(**args), split, lowercase_ok=False)


# ---------------------------------------------------------------------------------------------------------------
# Requests outside the families

_OUT_OF_SCOPE = (
    (
        "Hello!", "Hi", "Who are you?", "What can you do?", "What is your name?", "How are you today?",
        "Write a poem about the sea.", "Tell me a joke.", "What is the capital of France?", "Explain gravity.",
        "Translate thank you into French.", "What is the meaning of life?", "Can you help me with my homework?",
        "Recommend a good book.", "What day is it today?", "Write a short story about a dragon.",
        "Why is the sky blue?", "How do I cook rice?", "Multiply 12 by 7.", "What is 9 minus 4?",
        "Who won the world cup?", "Give me a recipe for pancakes.", "Are you a robot?", "Summarize this article.",
        "What is Python?", "good night", "thanks", "Count to ten.", "Spell the word apple.", "Divide 100 by 4.",
        "What is 3 times 8?", "Write code for me.", "Tell me about the moon.", "What's new?", "Sing a lullaby.",
        "How tall is a giraffe?",
    ),
    (
        "Hello, who are you?", "Write a haiku about autumn.", "What's up?", "Tell me about yourself.",
        "How tall is Mount Everest?", "Can you write code?", "What's 6 times 7?", "Sing me a song.",
    ),
)  # fmt: skip


def out_of_scope_request(rng: random.Random, split: str) -> str:
    return _dress(rng, _pick(rng, _OUT_OF_SCOPE, split), split)
