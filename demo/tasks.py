"""Procedurally generated chat tasks and a small tokenizer for the tiny demo Clover model.

The demo model is trained from scratch on CPU, so every task is short and every answer can be checked exactly:

- ``addition``: with thinking on, add two numbers of 3 to 6 digits; the reasoning is the digit-by-digit working,
  right to left, one line per column (``7+5+0=12 write 2 carry 1``), then ``answer N``. With thinking off the
  answer comes directly, so the operands have 2 or 3 digits (a sum a small model can learn to write at once).
  A level with ``column_sum_width=2`` writes column sums below 10 with a leading zero (``3+4+0=07 ...``), so every
  column line has the same number of tokens.
- ``sorting``: sort 5 to 12 integers from 0 to 99 ascending (sometimes descending, when the request says so).
- ``reversal``: reverse a sequence of 3 to 10 common English words.
- ``tool_call``: the system turn lists 1 or 2 tools (the list dominates the prompt, so it is kept short); the target is either the assistant's tool call, or the final
  answer after the tool's response, a templated sentence that restates the result.

Answer formats (the assistant's ``content``, compared exactly after ``strip()`` by :func:`check_reply`):

- addition: ``"{a} + {b} = {a + b}"`` with the operands in the order the request names them;
- sorting: the sorted numbers joined by ``", "``;
- reversal: the reversed words joined by single spaces;
- tool call: exactly one tool call whose name and arguments equal the expected ones (``expected`` is the JSON
  ``{"name": ..., "arguments": {...}}``; arguments are compared as the chat template renders them, as strings);
- tool final answer: the tool's sentence, e.g. ``"It is 18 degrees celsius and sunny in Paris."``.

With thinking on, families other than addition get a one-line reasoning. Conversations are rendered with the
project's Qwen3.5-style chat template (``tokenizer_config/chat_template.jinja``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chat_clover import parse_reply
from . import wordings

__all__ = [
    "FAMILIES",
    "OUT_OF_SCOPE",
    "WORDINGS",
    "DATA_POSITIONS",
    "SPECIAL_TOKENS",
    "LEVELS",
    "DemoExample",
    "DemoLevel",
    "addition_working",
    "build_demo_tokenizer",
    "check_reply",
    "data_position",
    "encode_example",
    "generate_examples",
    "is_tool_call_target",
    "make_example",
    "write_chat_jsonl",
]

FAMILIES: tuple[str, ...] = ("addition", "sorting", "reversal", "tool_call")
# Requests outside the four families, answered with one fixed reply (`wordings.OUT_OF_SCOPE_REPLY`).
OUT_OF_SCOPE = "out_of_scope"
WORDINGS = ("templates", *wordings.SPLITS)

# Added at the end of the vocabulary, in this order (the last one gets id vocab_size - 1).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|mask|>",
)
# As in Qwen3.5, the markup tokens are added tokens that are *not* special, so `skip_special_tokens=True` keeps them.
_NON_SPECIAL_MARKUP = frozenset(SPECIAL_TOKENS[3:9])

# Qwen2/3.5-style pre-tokenizer pattern, except that a word takes at most a space before it (Qwen's takes any one
# non-letter); `\p{N}` on its own splits every digit into its own pre-token.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)| ?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "tokenizer_config" / "chat_template.jinja"


@dataclass
class DemoExample:
    """One training/evaluation conversation.

    `messages` ends with the assistant message that is the training target; `expected` is what `check_reply`
    compares a generated reply with (see the module docstring for the formats).
    """

    family: str
    messages: list[dict]
    tools: list[dict] | None
    enable_thinking: bool
    expected: str

    def to_record(self) -> dict:
        """The example as a line of the chat JSONL that scripts/train.py reads (family and expected answer kept)."""
        record = {"messages": self.messages, "enable_thinking": self.enable_thinking}
        if self.tools:
            record["tools"] = self.tools
        return record | {"family": self.family, "expected": self.expected}


@dataclass(frozen=True)
class DemoLevel:
    """How big the problems of each family are. "full" is the task as evaluated; "warmup" starts a curriculum.

    Why a warm-up: a small model learns to copy from the prompt only after a sudden transition, and the transition
    comes much later the more distinct items there are to copy. Measured (copy/reverse of 3-8 words, the demo's
    width, causal, vocabulary of 2,048): with 64 distinct words the transition came after about 175 steps, with 400
    not within 600; started on 64 words for 250 steps, the same model then reached 83% on the 400 within 150 steps
    and 98% within 250. So training starts with fewer, shorter problems from a small pool of words, then goes on to
    the full task.
    """

    direct_addition_digits: tuple[int, int]  # operand digits, answered at once (thinking off)
    worked_addition_digits: tuple[int, int]  # operand digits, worked out column by column (thinking on)
    numbers_to_sort: tuple[int, int]
    words_to_reverse: tuple[int, int]
    word_pool: int  # reversal words come from the first word_pool of the word list
    # Digits of a worked line's column sum. 2 writes sums below 10 with a leading zero (``3+4+0=07``), so every
    # column line has the same length and a position alone says which kind of token goes there: block diffusion
    # commits far-apart positions in one forward, and with 1 a line's length depends on a sum not yet written.
    column_sum_width: int = 1


LEVELS = {
    "full": DemoLevel((2, 3), (3, 6), (5, 12), (3, 10), word_pool=10**6),
    "warmup": DemoLevel((2, 2), (3, 4), (5, 7), (3, 6), word_pool=64),
    # The top of each family's range in "full", where a trained model's errors gather: measured on 1,600 held-out
    # problems, the shipped Clover at threshold 0.95 reverses 3-8 words 95% right, 9 words 77%, 10 words 37%;
    # works out additions of up to 5 digits 87% right, of 6 digits 69%; sums 2-digit numbers directly 96% right,
    # 3-digit ones 81%.
    "hard": DemoLevel((3, 3), (5, 6), (9, 12), (8, 10), word_pool=10**6),
    # Every size a user may ask about: single-digit sums answered at once, two-digit ones worked out too.
    "wide": DemoLevel((1, 3), (2, 6), (5, 12), (3, 10), word_pool=10**6),
}


# ----------------------------------------------------------------------------------------------------------------
# Shared phrasing

_SYSTEM_PROMPTS = (
    None,
    None,
    "You are a helpful assistant.",
    "You are a careful assistant. Answer concisely.",
    "You are a precise assistant. Give only the answer.",
    "Answer the user's request exactly.",
)

_TOOL_SYSTEM_PROMPTS = (
    None,
    None,
    "You are a helpful assistant.",
    "You are an assistant that can use tools.",
    "Use a tool when it helps.",
)

# A few hundred common English words (lower case, letters only, no duplicates).
_WORDS = tuple(
    """
    apple bread chair dog egg fish garden house island jacket kite lamp moon nest orange pencil queen river sun
    table umbrella village window yellow zebra able about above across act add after again age ago air all almost
    alone along always amount angry animal answer arm army around art ask away baby back bad bag ball band bank
    base basket bath bear beat bed bell belt bench best big bird black blue boat body bone book boot bottle box boy
    brain branch brave bridge bright bring brother brown brush build burn bus busy butter button cake call calm
    camera camp candle cap car card care carry cat cave center chain chalk change cheap cheese chest child city
    class clean clear climb clock close cloud coat coffee cold color comb cook cool copper corn cotton country cow
    crowd cup curtain cut dance dark day deep desk dinner dirty door dream dress drink drive drop dry duck dust
    early earth east easy eat edge empty engine evening eye face fact fair fall family farm fast father field fire
    flag flat floor flower fly fog food foot forest fork free fresh friend frog front fruit full game gate gift
    girl glass glove goat gold good grass green grey ground group guitar hair half hall hand happy hard hat head
    heart heavy hill hole home honey hook horse hot hour hungry ice idea ink iron jam job joke juice jump key king
    kitchen knee knife lake land large late leaf left leg lemon letter light line lion lip list little lock long
    loud love low lucky lunch machine map market milk mind minute mirror money monkey month morning mother mountain
    mouse mouth music nail name narrow near neck needle new news night noise north nose note number ocean office
    oil old open owl page paint paper park party path peace pen people pepper piano picture pig pink pipe place
    plane plant plate pocket point pool poor potato pretty prize proud pull purple quick quiet rabbit rain red
    rice rich right ring road rock roof room root rope round salt sand school sea seat seed shadow sheep shelf
    ship shirt shoe short silver simple sister sky sleep slow small smile smoke snake snow soap sock soft song
    soup south spoon spring square star steam stone storm story street strong sugar summer sweet swim tail tall
    tea teacher tent thin thread tiger time tired toast today tooth top tower town toy train tree truck turtle
    uncle under up valley voice wall warm watch water wave weak west wet wheel white wide wild wind winter wise
    wolf wood wool word work world young
    """.split()
)

_NAMES = ("alice", "bob", "carol", "dave", "emma", "frank", "grace", "henry", "iris", "jack", "kate", "leo")
_CITIES = (
    "Paris",
    "London",
    "Tokyo",
    "Berlin",
    "Madrid",
    "Rome",
    "Cairo",
    "Lima",
    "Oslo",
    "Seoul",
    "Sydney",
    "Toronto",
    "Dublin",
    "Vienna",
    "Lisbon",
    "Prague",
    "Athens",
    "Boston",
    "Chicago",
    "Denver",
    "Mumbai",
    "Nairobi",
    "Istanbul",
    "Warsaw",
)
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "INR", "CNY")
_SYMBOLS = ("AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "IBM", "INTC", "ORCL", "NFLX", "AMD", "SAP")
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear")
_TIMER_LABELS = ("tea", "pasta", "laundry", "workout", "meeting", "nap", "oven", "break", "reading", "bread")
_SUBJECTS = ("lunch", "meeting notes", "invoice", "weekend plans", "project update", "hello", "the report", "travel")
_RESTAURANTS = ("Blue Door", "Green Leaf", "Sakura", "The Oak", "Casa Roja", "Golden Dragon", "Le Jardin", "Pier 9")


def _pick_system(rng: random.Random, prompts: Sequence[str | None]) -> list[dict]:
    system = rng.choice(prompts)
    return [] if system is None else [{"role": "system", "content": system}]


def _assistant(content: str, reasoning: str | None, enable_thinking: bool, **extra: Any) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if enable_thinking and reasoning:
        message["reasoning_content"] = reasoning
    message.update(extra)
    return message


# ----------------------------------------------------------------------------------------------------------------
# Addition


def addition_working(a: int, b: int, column_sum_width: int = 1) -> str:
    """The digit-by-digit working for ``a + b``: one line per column, right to left, then ``answer N``.

    Each column line is ``{digit of a}+{digit of b}+{carry in}={column sum} write {sum % 10} carry {sum // 10}``
    (a missing digit of the shorter number is 0), the column sum zero-padded to `column_sum_width` digits; a final
    carry adds ``carry 1 write 1``.
    """
    da, db = str(a)[::-1], str(b)[::-1]
    carry, lines = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}+{carry}={s:0{column_sum_width}d} write {s % 10} carry {s // 10}")
        carry = s // 10
    if carry:
        lines.append(f"carry {carry} write {carry}")
    lines.append(f"answer {a + b}")
    return "\n".join(lines)


_ADDITION_REQUESTS = (
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "Compute {a} plus {b}.",
    "Please calculate the sum of {a} and {b}.",
    "{a} + {b} = ?",
    "What do you get if you add {a} and {b}?",
    "Work out {a} + {b}.",
    "Find the sum: {a} + {b}",
)


def _make_addition(rng: random.Random, enable_thinking: bool, level: DemoLevel, wording: str) -> DemoExample:
    digits = level.worked_addition_digits if enable_thinking else level.direct_addition_digits
    a = _random_number(rng, *digits)
    b = _random_number(rng, *digits)
    answer = f"{a} + {b} = {a + b}"
    messages = _pick_system(rng, _SYSTEM_PROMPTS)
    if wording == "templates":
        request = rng.choice(_ADDITION_REQUESTS).format(a=a, b=b)
    else:
        request = wordings.addition_request(rng, a, b, wording)
    messages.append({"role": "user", "content": request})
    messages.append(_assistant(answer, addition_working(a, b, level.column_sum_width), enable_thinking))
    return DemoExample("addition", messages, None, enable_thinking, answer)


def _random_number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


# ----------------------------------------------------------------------------------------------------------------
# Sorting

_SORT_ASC_REQUESTS = (
    "Sort these numbers in ascending order: {nums}",
    "Put the following numbers in increasing order: {nums}",
    "Arrange from smallest to largest: {nums}",
    "Sort ascending: {nums}",
    "Please sort: {nums}",
    "Order these from lowest to highest: {nums}",
)
_SORT_DESC_REQUESTS = (
    "Sort these numbers in descending order: {nums}",
    "Arrange from largest to smallest: {nums}",
    "Put the following numbers in decreasing order: {nums}",
    "Sort descending: {nums}",
)


def _make_sorting(rng: random.Random, enable_thinking: bool, level: DemoLevel, wording: str) -> DemoExample:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(*level.numbers_to_sort))]
    descending = rng.random() < 0.25
    ordered = sorted(nums, reverse=descending)
    answer = ", ".join(map(str, ordered))
    if wording == "templates":
        sep = rng.choice((", ", ", ", " "))
        templates = _SORT_DESC_REQUESTS if descending else _SORT_ASC_REQUESTS
        request = rng.choice(templates).format(nums=sep.join(map(str, nums)))
    else:
        request = wordings.sorting_request(rng, nums, descending, wording)
    order = "descending" if descending else "ascending"
    reasoning = f"{len(nums)} numbers, {order} order: smallest {min(nums)}, largest {max(nums)}."
    messages = _pick_system(rng, _SYSTEM_PROMPTS)
    messages.append({"role": "user", "content": request})
    messages.append(_assistant(answer, reasoning, enable_thinking))
    return DemoExample("sorting", messages, None, enable_thinking, answer)


# ----------------------------------------------------------------------------------------------------------------
# Reversal

_REVERSAL_REQUESTS = (
    "Reverse the order of these words: {words}",
    "Write these words in reverse order: {words}",
    "Reverse this list of words: {words}",
    "Give me these words from last to first: {words}",
    "Please reverse: {words}",
    "Say these words backwards, last word first: {words}",
)


def _make_reversal(rng: random.Random, enable_thinking: bool, level: DemoLevel, wording: str) -> DemoExample:
    pool = _WORDS[: level.word_pool]
    words = [rng.choice(pool) for _ in range(rng.randint(*level.words_to_reverse))]
    answer = " ".join(reversed(words))
    if wording == "templates":
        sep = rng.choice((" ", " ", ", "))
        request = rng.choice(_REVERSAL_REQUESTS).format(words=sep.join(words))
    else:
        request = wordings.reversal_request(rng, words, wording)
    reasoning = f"{len(words)} words; the last one, {words[-1]}, comes first and {words[0]} comes last."
    messages = _pick_system(rng, _SYSTEM_PROMPTS)
    messages.append({"role": "user", "content": request})
    messages.append(_assistant(answer, reasoning, enable_thinking))
    return DemoExample("reversal", messages, None, enable_thinking, answer)


# ----------------------------------------------------------------------------------------------------------------
# Tool calls


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    params: tuple[tuple[str, str, str, tuple[str, ...] | None], ...]  # (name, json type, description, enum)
    requests: tuple[str, ...]  # formatted with the arguments
    purpose: str  # formatted with the arguments; used in the one-line reasoning
    make_args: Callable[[random.Random], dict[str, Any]]
    make_result: Callable[[random.Random, dict[str, Any]], dict[str, Any]]
    answer: str  # formatted with the arguments and the result fields

    def schema(self) -> dict:
        properties = {}
        for pname, ptype, pdesc, enum in self.params:
            prop: dict[str, Any] = {"type": ptype, "description": pdesc}
            if enum:
                prop["enum"] = list(enum)
            properties[pname] = prop
        parameters = {"type": "object", "properties": properties, "required": [p[0] for p in self.params]}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }


def _code(rng: random.Random, letter: str) -> str:
    return f"{letter}{rng.randint(1000, 9999)}"


def _two_cities(rng: random.Random) -> dict[str, Any]:
    origin, destination = rng.sample(_CITIES, 2)
    return {"origin": origin, "destination": destination}


def _two_currencies(rng: random.Random) -> dict[str, Any]:
    src, dst = rng.sample(_CURRENCIES, 2)
    return {
        "amount": rng.choice((rng.randint(1, 100), rng.randint(1, 20) * 50)),
        "from_currency": src,
        "to_currency": dst,
    }


_TOOLS: tuple[_Tool, ...] = (
    _Tool(
        name="get_weather",
        description="Get the current weather in a city.",
        params=(
            ("city", "string", "City name", None),
            ("unit", "string", "Temperature unit", ("celsius", "fahrenheit")),
        ),
        requests=(
            "What's the weather in {city} in {unit}?",
            "Check the weather for {city}, in {unit} please.",
            "How warm is it in {city} right now? Use {unit}.",
            "Tell me the current weather in {city} (in {unit}).",
        ),
        purpose="the weather in {city}",
        make_args=lambda rng: {"city": rng.choice(_CITIES), "unit": rng.choice(("celsius", "fahrenheit"))},
        make_result=lambda rng, args: {
            "city": args["city"],
            "temperature": rng.randint(-10, 35) if args["unit"] == "celsius" else rng.randint(14, 95),
            "unit": args["unit"],
            "condition": rng.choice(_CONDITIONS),
        },
        answer="It is {temperature} degrees {unit} and {condition} in {city}.",
    ),
    _Tool(
        name="convert_currency",
        description="Convert an amount of money from one currency to another.",
        params=(
            ("amount", "integer", "Amount to convert", None),
            ("from_currency", "string", "Currency code to convert from", None),
            ("to_currency", "string", "Currency code to convert to", None),
        ),
        requests=(
            "Convert {amount} {from_currency} to {to_currency}.",
            "How much is {amount} {from_currency} in {to_currency}?",
            "Please change {amount} {from_currency} into {to_currency}.",
            "What are {amount} {from_currency} worth in {to_currency}?",
        ),
        purpose="{amount} {from_currency} converted to {to_currency}",
        make_args=_two_currencies,
        make_result=lambda rng, args: {
            "amount": args["amount"],
            "from": args["from_currency"],
            "to": args["to_currency"],
            "converted": f"{args['amount'] * rng.uniform(0.05, 20):.2f}",
        },
        answer="{amount} {from_currency} is {converted} {to_currency}.",
    ),
    _Tool(
        name="lookup_stock",
        description="Look up the latest price of a stock.",
        params=(("symbol", "string", "Ticker symbol", None),),
        requests=(
            "What is the stock price of {symbol}?",
            "Look up the share price for {symbol}.",
            "How much is {symbol} trading at?",
            "Get me a quote for {symbol}.",
        ),
        purpose="the price of {symbol}",
        make_args=lambda rng: {"symbol": rng.choice(_SYMBOLS)},
        make_result=lambda rng, args: {
            "symbol": args["symbol"],
            "price": f"{rng.randint(5, 900)}.{rng.randint(0, 99):02d}",
            "currency": "USD",
        },
        answer="{symbol} is trading at {price} USD.",
    ),
    _Tool(
        name="set_timer",
        description="Start a countdown timer.",
        params=(
            ("minutes", "integer", "Length of the timer in minutes", None),
            ("label", "string", "Name of the timer", None),
        ),
        requests=(
            "Set a timer for {minutes} minutes called {label}.",
            "Start a {minutes} minute timer named {label}.",
            "Please set a {label} timer for {minutes} minutes.",
            "Timer for {minutes} minutes, label it {label}.",
        ),
        purpose="a {minutes} minute timer",
        make_args=lambda rng: {"minutes": rng.randint(1, 120), "label": rng.choice(_TIMER_LABELS)},
        make_result=lambda rng, args: {"timer_id": _code(rng, "T"), "minutes": args["minutes"], "status": "running"},
        answer="Timer {timer_id} is set for {minutes} minutes.",
    ),
    _Tool(
        name="send_email",
        description="Send a short email.",
        params=(
            ("to", "string", "Recipient address", None),
            ("subject", "string", "Subject line", None),
        ),
        requests=(
            "Send an email to {to} with the subject {subject}.",
            "Email {to}, subject: {subject}.",
            "Please write to {to} with subject {subject}.",
            "Send {to} a message titled {subject}.",
        ),
        purpose="an email to {to}",
        make_args=lambda rng: {"to": f"{rng.choice(_NAMES)}@example.com", "subject": rng.choice(_SUBJECTS)},
        make_result=lambda rng, args: {"status": "sent", "message_id": _code(rng, "M")},
        answer="Email {message_id} was sent to {to}.",
    ),
    _Tool(
        name="get_time",
        description="Get the local time in a city.",
        params=(("city", "string", "City name", None),),
        requests=(
            "What time is it in {city}?",
            "Tell me the local time in {city}.",
            "What's the current time in {city}?",
            "Check the clock in {city} for me.",
        ),
        purpose="the time in {city}",
        make_args=lambda rng: {"city": rng.choice(_CITIES)},
        make_result=lambda rng, args: {
            "city": args["city"],
            "time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
        },
        answer="It is {time} in {city}.",
    ),
    _Tool(
        name="get_distance",
        description="Get the distance in kilometers between two cities.",
        params=(
            ("origin", "string", "Start city", None),
            ("destination", "string", "End city", None),
        ),
        requests=(
            "How far is it from {origin} to {destination}?",
            "What is the distance between {origin} and {destination}?",
            "Find the distance from {origin} to {destination}.",
            "How many kilometers from {origin} to {destination}?",
        ),
        purpose="the distance from {origin} to {destination}",
        make_args=_two_cities,
        make_result=lambda rng, args: {"km": rng.randint(50, 15000)},
        answer="The distance from {origin} to {destination} is {km} km.",
    ),
    _Tool(
        name="book_table",
        description="Reserve a table at a restaurant.",
        params=(
            ("restaurant", "string", "Restaurant name", None),
            ("people", "integer", "Number of guests", None),
        ),
        requests=(
            "Book a table for {people} at {restaurant}.",
            "Reserve a table at {restaurant} for {people} people.",
            "Can you get us a table for {people} at {restaurant}?",
            "I need a reservation at {restaurant} for {people}.",
        ),
        purpose="a table at {restaurant}",
        make_args=lambda rng: {"restaurant": rng.choice(_RESTAURANTS), "people": rng.randint(1, 12)},
        make_result=lambda rng, args: {"confirmation": _code(rng, "R"), "restaurant": args["restaurant"]},
        answer="Table for {people} at {restaurant} is booked, confirmation {confirmation}.",
    ),
)


def demo_tool_schemas() -> list[dict]:
    """The JSON schemas of every tool the demo model was trained to call (`apply_chat_template(tools=...)`)."""
    return [tool.schema() for tool in _TOOLS]


def _make_tool_call(rng: random.Random, enable_thinking: bool, level: DemoLevel, wording: str) -> DemoExample:
    tool = rng.choice(_TOOLS)
    others = [t for t in _TOOLS if t is not tool]
    offered = [tool, *rng.sample(others, rng.randint(0, 1))]
    rng.shuffle(offered)
    tools = [t.schema() for t in offered]
    args = tool.make_args(rng)
    final_target = rng.random() < 0.5

    messages = _pick_system(rng, _TOOL_SYSTEM_PROMPTS)
    if wording == "templates":
        request = rng.choice(tool.requests).format(**args)
    else:
        request = wordings.tool_request(rng, tool.name, tool.requests, args, wording)
    messages.append({"role": "user", "content": request})
    call = {"type": "function", "function": {"name": tool.name, "arguments": dict(args)}}
    call_reasoning = f"The user wants {tool.purpose.format(**args)}, so I call {tool.name}."
    messages.append(_assistant("", call_reasoning, enable_thinking, tool_calls=[call]))
    if not final_target:
        return DemoExample(
            "tool_call", messages, tools, enable_thinking, json.dumps({"name": tool.name, "arguments": args})
        )

    result = tool.make_result(rng, args)
    messages.append({"role": "tool", "name": tool.name, "content": json.dumps(result)})
    answer = tool.answer.format(**{**args, **result})
    messages.append(_assistant(answer, f"{tool.name} returned a result; I report it.", enable_thinking))
    return DemoExample("tool_call", messages, tools, enable_thinking, answer)


# ----------------------------------------------------------------------------------------------------------------
# Requests outside the families


def _make_out_of_scope(rng: random.Random, enable_thinking: bool, level: DemoLevel, wording: str) -> DemoExample:
    split = "train" if wording == "templates" else wording
    messages = _pick_system(rng, _SYSTEM_PROMPTS)
    messages.append({"role": "user", "content": wordings.out_of_scope_request(rng, split)})
    reply = wordings.OUT_OF_SCOPE_REPLY
    messages.append(_assistant(reply, wordings.OUT_OF_SCOPE_REASONING, enable_thinking))
    return DemoExample(OUT_OF_SCOPE, messages, None, enable_thinking, reply)


# ----------------------------------------------------------------------------------------------------------------
# Public API

_MAKERS: dict[str, Callable[[random.Random, bool, DemoLevel, str], DemoExample]] = {
    "addition": _make_addition,
    "sorting": _make_sorting,
    "reversal": _make_reversal,
    "tool_call": _make_tool_call,
    OUT_OF_SCOPE: _make_out_of_scope,
}


def make_example(
    family: str,
    rng: random.Random,
    enable_thinking: bool | None = None,
    level: str | DemoLevel = "full",
    wording: str = "templates",
) -> DemoExample:
    """One example of `family` (one of `FAMILIES` or `OUT_OF_SCOPE`); thinking on or off at random (half each)
    unless `enable_thinking` is given. `level` is a key of `LEVELS` ("full", the task as evaluated; "warmup";
    "hard", its largest problems; "wide", every size a user may ask about) or a `DemoLevel`. `wording` is
    "templates" (the original request templates), "train" (the wording bank's training part, `demo.wordings`) or
    "held_out" (its held-out part, which training never sees).

    For ``tool_call`` the target is, half of the time each, the tool-call turn or the final answer after the tool's
    response (see :func:`is_tool_call_target`).
    """
    if family not in _MAKERS:
        raise ValueError(f"Unknown family {family!r}; expected one of {tuple(_MAKERS)}")
    if wording not in WORDINGS:
        raise ValueError(f"Unknown wording {wording!r}; expected one of {WORDINGS}")
    if not isinstance(level, DemoLevel):
        if level not in LEVELS:
            raise ValueError(f"Unknown level {level!r}; expected one of {sorted(LEVELS)} or a DemoLevel")
        level = LEVELS[level]
    if enable_thinking is None:
        enable_thinking = rng.random() < 0.5
    return _MAKERS[family](rng, bool(enable_thinking), level, wording)


def generate_examples(
    num_examples: int,
    seed: int,
    families: Sequence[str] = FAMILIES,
    weights: Sequence[float] | None = None,
    level: str | DemoLevel = "full",
    enable_thinking: bool | None = None,
    wording: str = "templates",
) -> list[DemoExample]:
    """`num_examples` examples of `families` at `level` worded as `wording` says (see `make_example`),
    deterministic in `seed`; thinking on or off at random (half each) unless `enable_thinking` is given.

    Without `weights` the families take turns (balanced to within one), as an evaluation wants. With `weights`
    (one per family) each example's family is drawn with those relative frequencies, so a training mix can spend
    fewer examples on a family whose prompts are long (the tool lists) and more on the ones that are hard to learn.
    """
    rng = random.Random(seed)
    if weights is None:
        chosen = [families[i % len(families)] for i in range(num_examples)]
    else:
        if len(weights) != len(families) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(
                f"weights={list(weights)} must give one non-negative weight per family of {tuple(families)}, "
                "not all zero"
            )
        chosen = rng.choices(families, weights=weights, k=num_examples)
    return [make_example(family, rng, enable_thinking, level, wording) for family in chosen]


def read_problems(path: str | Path) -> list[DemoExample]:
    """Problems written as `DemoExample.to_record()` lines (messages ending with the expected reply, family,
    expected, enable_thinking, tools), e.g. requests worded apart from the generator (`demo/own_wordings.jsonl`)."""
    examples = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("family") not in _MAKERS or "expected" not in record:
            raise ValueError(
                f"{path}:{number}: a problem needs a family (one of {tuple(_MAKERS)}) and an expected reply."
            )
        examples.append(
            DemoExample(
                record["family"],
                record["messages"],
                record.get("tools"),
                record.get("enable_thinking", True),
                record["expected"],
            )  # fmt: skip
        )
    return examples


def write_chat_jsonl(examples: Sequence[DemoExample], path: str | Path) -> None:
    """Writes the examples as chat JSONL (one `DemoExample.to_record()` per line), atomically."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    with open(staging, "w", encoding="utf-8") as handle:
        for example in examples:
            handle.write(json.dumps(example.to_record(), ensure_ascii=False) + "\n")
    staging.replace(path)


def is_tool_call_target(example: DemoExample) -> bool:
    """Whether the example's target message is a tool call (rather than text)."""
    return bool(example.messages[-1].get("tool_calls"))


def _as_rendered(value: Any) -> str:
    """A tool argument as the chat template writes it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


DATA_POSITIONS = ("data_last", "words_after")


def data_position(example: DemoExample) -> str | None:
    """Where an addition's, sort's or reversal's data stand in its request: "data_last" when nothing but
    punctuation follows them (as in every original template), "words_after" when words do ("... please", "...
    starting from the end"). None for the other families. A model that finds its data by their distance from the
    end of the request answers the first kind and fails the second."""
    if example.family not in ("addition", "sorting", "reversal"):
        return None
    request = next(m["content"] for m in reversed(example.messages) if m["role"] == "user")
    if example.family == "reversal":
        words = example.expected.split()[::-1]  # in the request's order
        between = r"[\s,\"']+(?:and[\s,\"']+)?"
        found = list(re.finditer(r"\b" + between.join(map(re.escape, words)) + r"\b", request, re.IGNORECASE))
        end = found[-1].end() if found else request.lower().rfind(words[-1].lower()) + len(words[-1])
    else:
        end = max(match.end() for match in re.finditer(r"\d", request))
    return "words_after" if re.search(r"[^\W\d_]", request[end:]) else "data_last"


def check_reply(example: DemoExample, reply_text: str) -> bool:
    """Exact check of a generated reply (the text the model produced after the generation prompt).

    With thinking on, the reply must contain ``</think>`` (the reasoning itself is not checked); the content after
    it is compared. Text answers must equal `example.expected` after ``strip()``; tool-call targets must contain
    exactly one tool call with the expected name and arguments (values compared as rendered strings).
    """
    if example.enable_thinking and "</think>" not in reply_text:
        return False
    parsed = parse_reply(reply_text, reasoning_open=example.enable_thinking)
    if is_tool_call_target(example):
        expected = json.loads(example.expected)
        calls = parsed.tool_calls
        if len(calls) != 1 or calls[0]["name"] != expected["name"]:
            return False
        got = {k: _as_rendered(v) for k, v in (calls[0]["arguments"] or {}).items()}
        want = {k: _as_rendered(v) for k, v in expected["arguments"].items()}
        return got == want
    return not parsed.tool_calls and parsed.content.strip() == example.expected.strip()


def _render(tokenizer, example: DemoExample, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=example.tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=example.enable_thinking,
        tokenize=False,
    )


def encode_example(tokenizer, example: DemoExample, max_length: int) -> tuple[list[int], list[int]]:
    """(prompt_ids, answer_ids) of an example, by `chat_data_clover.encode_chat_example` (the encoding training and
    evaluation share): with thinking on the prompt ends with ``<think>\\n`` and the answer is ``reasoning\\n
    </think>\\n\\ncontent<|im_end|>``; with thinking off the prompt ends with ``<think>\\n\\n</think>\\n\\n`` and the
    answer is ``content<|im_end|>``."""
    from ..chat_data_clover import encode_chat_example

    encoded = encode_chat_example(tokenizer, example.to_record(), max_length)
    return encoded["prompt_ids"], encoded["answer_ids"]


def _read_template(chat_template: str | Path | None) -> str:
    if chat_template is None:
        return _TEMPLATE_PATH.read_text()
    if isinstance(chat_template, Path) or ("{" not in chat_template and Path(chat_template).is_file()):
        return Path(chat_template).read_text()
    return chat_template


def build_demo_tokenizer(
    output_dir: str | Path,
    num_examples: int = 20000,
    vocab_size: int = 2048,
    seed: int = 0,
    chat_template: str | Path | None = None,
    wording: str = "templates",
):
    """Train a small byte-level BPE on rendered demo conversations and save it (with the chat template) to
    `output_dir`; returns ``AutoTokenizer.from_pretrained(output_dir)``.

    Digits are always single tokens (the pre-tokenizer isolates every digit); at the default 2,048 entries every
    task word and city is one token too (at 1,024 most words take two or three). The ten `SPECIAL_TOKENS` take the last
    ten ids, in order: ``<|endoftext|>`` (pad) = vocab_size - 10, ..., ``<|im_end|>`` (eos) = vocab_size - 8, ...,
    ``<|mask|>`` = vocab_size - 1. `chat_template` (template text or a path) defaults to the project's
    ``tokenizer_config/chat_template.jinja``. `wording` words the conversations it learns from (see `make_example`;
    "train" adds the requests outside the families).

    A word takes at most a space before it, never a quote or a bracket: `"lucky` is `"` then `lucky`, the tokens the
    word has at the start of a reply, so that a quoted word is copied as the reply writes it.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    template = _read_template(chat_template)
    num_base = vocab_size - len(SPECIAL_TOKENS)
    if num_base <= 256:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges beyond the 256 bytes")

    def new_tokenizer() -> Tokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        return tok

    def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            mask_token="<|mask|>",
            padding_side="left",
            model_max_length=1024,
            chat_template=template,
            clean_up_tokenization_spaces=False,
        )

    # Render the corpus with the real template (through a throw-away tokenizer, so rendering is exactly
    # apply_chat_template's), and train on the text between control tokens.
    renderer = wrap(new_tokenizer())
    control = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

    def corpus():
        families = FAMILIES if wording == "templates" else FAMILIES + (OUT_OF_SCOPE,)
        for example in generate_examples(num_examples, seed, families, wording=wording):
            text = _render(renderer, example, example.messages, add_generation_prompt=False)
            for piece in control.split(text):
                if piece:
                    yield piece

    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=num_base,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != num_base:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, expected {num_base}; use more examples")
    for token in SPECIAL_TOKENS:  # one at a time, so the ids follow SPECIAL_TOKENS' order
        tok.add_tokens([AddedToken(token, special=token not in _NON_SPECIAL_MARKUP, normalized=False)])
    for offset, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != num_base + offset:
            raise RuntimeError(f"{token} got id {tok.token_to_id(token)}, expected {num_base + offset}")

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    wrap(tok).save_pretrained(output_dir)
    # The reply parsers (transformers' response_template, and 5.2's response_schema) of the project's tokenizer.
    saved = json.loads((output_dir / "tokenizer_config.json").read_text())
    project = json.loads((_TEMPLATE_PATH.parent / "tokenizer_config.json").read_text())
    saved |= {key: project[key] for key in ("response_template", "response_schema")}
    (output_dir / "tokenizer_config.json").write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")
    return AutoTokenizer.from_pretrained(output_dir)
