"""Tests of the demo chat corpus and the demo tokenizer (CPU only, a few seconds)."""

import json
import random
import re
from dataclasses import replace

import pytest

from clover.demo import wordings
from clover.demo.tasks import (
    DATA_POSITIONS,
    FAMILIES,
    LEVELS,
    OUT_OF_SCOPE,
    SPECIAL_TOKENS,
    DemoExample,
    addition_working,
    build_demo_tokenizer,
    check_reply,
    data_position,
    encode_example,
    generate_examples,
    is_tool_call_target,
    make_example,
)

VOCAB_SIZE = 1024


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"), num_examples=4000, vocab_size=VOCAB_SIZE, seed=0)


def _examples_per_kind(seed=0, per_kind=6):
    """`per_kind` examples of every family with thinking on and off, and of both kinds of tool-call target."""
    rng = random.Random(seed)
    found = {}
    while len(found) < 10 or any(len(bucket) < per_kind for bucket in found.values()):
        for family in FAMILIES:
            for thinking in (True, False):
                example = make_example(family, rng, enable_thinking=thinking)
                bucket = found.setdefault((family, thinking, is_tool_call_target(example)), [])
                if len(bucket) < per_kind:
                    bucket.append(example)
    return [example for bucket in found.values() for example in bucket]


def _reference_reply(tokenizer, example, skip_special_tokens=False):
    _, answer_ids = encode_example(tokenizer, example, max_length=VOCAB_SIZE)
    return tokenizer.decode(answer_ids, skip_special_tokens=skip_special_tokens)


# ------------------------------------------------------------------------------------------------ corpus


def test_data_position_tells_requests_with_words_after_their_data():
    def example(family, request, expected):
        return DemoExample(family, [{"role": "user", "content": request}], None, False, expected)

    cases = [
        ("reversal", "Please reverse: dog sun", "sun dog", "data_last"),
        ("reversal", "Reverse 'dog, sun and bird'.", "bird sun dog", "data_last"),
        ("reversal", 'Turn "dog sun" around, please', "sun dog", "words_after"),
        ("reversal", "Words: back arm. Give them back reversed", "arm back", "words_after"),  # a data word again
        ("sorting", "Sort 3, 1 and 2 ascending.", "1, 2, 3", "words_after"),
        ("sorting", "Sort ascending: 3 1 2!", "1, 2, 3", "data_last"),
        ("addition", "What is 2 + 3?", "2 + 3 = 5", "data_last"),
        ("addition", "what's 2 plus 3, all together? ty", "2 + 3 = 5", "words_after"),
        ("tool_call", "What time is it in Oslo?", "{}", None),
    ]
    for family, request, expected, position in cases:
        assert data_position(example(family, request, expected)) == position, request
    templated = generate_examples(300, seed=5, families=("addition", "sorting", "reversal"), level="wide")
    assert {data_position(e) for e in templated} == {"data_last"}  # every original template ends with its data
    worded = generate_examples(300, seed=5, families=("addition", "sorting", "reversal"), wording="train")
    assert {data_position(e) for e in worded} == set(DATA_POSITIONS)


def test_generate_examples_is_deterministic_and_balanced():
    a = generate_examples(64, seed=7)
    assert a == generate_examples(64, seed=7)
    assert a != generate_examples(64, seed=8)
    counts = {family: sum(e.family == family for e in a) for family in FAMILIES}
    assert counts == {family: 16 for family in FAMILIES}
    assert 10 < sum(e.enable_thinking for e in a) < 54
    only = generate_examples(9, seed=1, families=("sorting", "reversal"))
    assert [e.family for e in only] == ["sorting", "reversal"] * 4 + ["sorting"]


def test_generate_examples_with_weights_follows_the_mix():
    mixed = generate_examples(2000, seed=3, weights=[0.5, 0.3, 0.2, 0.0])
    assert mixed == generate_examples(2000, seed=3, weights=[0.5, 0.3, 0.2, 0.0])
    counts = {family: sum(e.family == family for e in mixed) for family in FAMILIES}
    assert counts["tool_call"] == 0
    assert 900 < counts["addition"] < 1100 and 500 < counts["sorting"] < 700 and 300 < counts["reversal"] < 500
    for bad in ([1.0, 1.0], [1.0, -1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match="one non-negative weight per family"):
            generate_examples(10, seed=0, weights=bad)


def test_generate_examples_can_fix_the_thinking_mode():
    direct = generate_examples(50, seed=4, families=("addition",), level="warmup", enable_thinking=False)
    assert not any(example.enable_thinking for example in direct)
    for example in direct:
        assert example.messages[-1]["content"] == example.expected and "reasoning_content" not in example.messages[-1]
        a, b = map(int, re.findall(r"\d+", example.messages[-2]["content"]))
        assert 10 <= a < 100 and 10 <= b < 100 and example.expected == f"{a} + {b} = {a + b}"
    assert all(e.enable_thinking for e in generate_examples(8, seed=4, enable_thinking=True))


def test_example_structure():
    rng = random.Random(0)
    for family in FAMILIES:
        for thinking in (True, False):
            for _ in range(20):
                example = make_example(family, rng, enable_thinking=thinking)
                assert isinstance(example, DemoExample)
                assert example.family == family and example.enable_thinking is thinking
                target = example.messages[-1]
                assert target["role"] == "assistant"
                assistants = [m for m in example.messages if m["role"] == "assistant"]
                has_reasoning = ["reasoning_content" in m for m in assistants]
                assert all(has_reasoning) if thinking else not any(has_reasoning)
                if family == "tool_call":
                    assert example.tools and 1 <= len(example.tools) <= 2
                    names = [t["function"]["name"] for t in example.tools]
                    if is_tool_call_target(example):
                        assert target["content"] == "" and json.loads(example.expected)["name"] in names
                    else:
                        assert [m["role"] for m in example.messages[-3:]] == ["assistant", "tool", "assistant"]
                        assert target["content"] == example.expected
                else:
                    assert example.tools is None and target["content"] == example.expected
    with pytest.raises(ValueError):
        make_example("poetry", rng)


def test_family_answers_are_right():
    rng = random.Random(3)
    for _ in range(200):
        ex = make_example("addition", rng)
        a, b = map(int, re.findall(r"\d+", ex.messages[-2]["content"]))
        if ex.enable_thinking:  # 3-6 digits, worked out column by column
            assert 100 <= a < 10**6 and 100 <= b < 10**6
        else:  # answered at once: 2-3 digits
            assert 10 <= a < 1000 and 10 <= b < 1000
        assert ex.expected == f"{a} + {b} = {a + b}"

        ex = make_example("sorting", rng)
        nums = [int(x) for x in re.findall(r"\d+", ex.messages[-2]["content"])]
        assert 5 <= len(nums) <= 12
        descending = any(w in ex.messages[-2]["content"] for w in ("descending", "largest to", "decreasing"))
        assert ex.expected == ", ".join(map(str, sorted(nums, reverse=descending)))

        ex = make_example("reversal", rng)
        words = ex.messages[-2]["content"].split(":", 1)[1].replace(",", " ").split()
        assert 3 <= len(words) <= 10 and ex.expected == " ".join(words[::-1])

        ex = make_example("tool_call", rng)
        if not is_tool_call_target(ex):
            call = ex.messages[-3]["tool_calls"][0]["function"]
            result = json.loads(ex.messages[-2]["content"])
            # the final sentence restates the result (and the arguments, but for free-text labels and subjects)
            shown = {k: v for k, v in result.items() if k != "status"}
            shown.update({k: v for k, v in call["arguments"].items() if k not in ("label", "subject")})
            for value in shown.values():
                assert str(value) in ex.expected, (value, ex.expected)


def test_warmup_level_draws_smaller_problems_from_a_small_word_pool():
    from clover.demo.tasks import _WORDS, LEVELS

    rng = random.Random(5)
    pool = set(_WORDS[: LEVELS["warmup"].word_pool])
    for _ in range(100):
        reversal = make_example("reversal", rng, enable_thinking=False, level="warmup")
        words = reversal.expected.split()
        assert 3 <= len(words) <= 6 and set(words) <= pool
        sorting = make_example("sorting", rng, enable_thinking=False, level="warmup")
        assert 5 <= len(sorting.expected.split(", ")) <= 7
        addition = make_example("addition", rng, enable_thinking=True, level="warmup")
        a, b = map(int, re.findall(r"\d+", addition.messages[-2]["content"]))
        assert 100 <= a < 10**4 and 100 <= b < 10**4
    with pytest.raises(ValueError, match="Unknown level 'huge'"):
        make_example("sorting", rng, level="huge")


def test_hard_level_draws_the_top_of_each_full_range():
    """The "hard" level keeps every size inside the evaluated task ("full"), drawn from the top of its range."""
    full, hard = LEVELS["full"], LEVELS["hard"]
    for field in ("direct_addition_digits", "worked_addition_digits", "numbers_to_sort", "words_to_reverse"):
        (low, high), (hard_low, hard_high) = getattr(full, field), getattr(hard, field)
        assert low < hard_low <= hard_high == high, field
    rng = random.Random(11)
    for _ in range(100):
        assert 8 <= len(make_example("reversal", rng, level="hard").expected.split()) <= 10
        assert 9 <= len(make_example("sorting", rng, level="hard").expected.split(", ")) <= 12
        direct = make_example("addition", rng, enable_thinking=False, level="hard")
        assert re.fullmatch(r"\d{3} \+ \d{3} = \d+", direct.expected), direct.expected
        worked = make_example("addition", rng, enable_thinking=True, level="hard")
        a, b = map(int, re.findall(r"\d+", worked.messages[-2]["content"]))
        assert 10**4 <= a < 10**6 and 10**4 <= b < 10**6


def test_addition_working_is_arithmetically_right():
    rng = random.Random(1234)
    cases = [(999, 1), (100, 900), (999999, 999999), (123, 456789)]
    cases += [(rng.randint(100, 999999), rng.randint(100, 999999)) for _ in range(500)]
    line_re = re.compile(r"^(\d)\+(\d)\+(\d)=(\d+) write (\d) carry (\d)$")
    for a, b in cases:
        lines = addition_working(a, b).split("\n")
        assert lines[-1] == f"answer {a + b}"
        carry, written = 0, []
        for column, line in enumerate(lines[:-1]):
            m = line_re.match(line)
            if m is None:  # only the final carry line is not a column line
                assert line == f"carry {carry} write {carry}" and carry == 1 and column == len(lines) - 2
                written.append(carry)
                continue
            x, y, c, s, w, out = map(int, m.groups())
            assert x == (a // 10**column) % 10 and y == (b // 10**column) % 10
            assert c == carry and s == x + y + c and w == s % 10 and out == s // 10
            written.append(w)
            carry = out
        assert int("".join(map(str, reversed(written)))) == a + b
    # a thinking example carries exactly this working
    rng = random.Random(5)
    example = make_example("addition", rng, enable_thinking=True)
    a, b = map(int, re.findall(r"\d+", example.messages[-2]["content"]))
    assert example.messages[-1]["reasoning_content"] == addition_working(a, b)


def test_fixed_width_working_gives_every_column_line_one_length(tokenizer):
    """With column_sum_width=2 a column line is the same tokens long whatever its sum, and means the same."""
    rng = random.Random(7)
    lengths = {1: set(), 2: set()}
    for a, b in [(rng.randint(100, 999999), rng.randint(100, 999999)) for _ in range(200)]:
        plain, fixed = addition_working(a, b).split("\n"), addition_working(a, b, column_sum_width=2).split("\n")
        assert [re.sub(r"=0(\d) ", r"=\1 ", line) for line in fixed] == plain
        for width, lines in ((1, plain), (2, fixed)):
            for line in (line for line in lines if "+" in line):  # the column lines
                lengths[width].add(len(tokenizer(line, add_special_tokens=False)["input_ids"]))
    assert len(lengths[2]) == 1
    assert len(lengths[1]) == 2  # what the option removes: a sum of 10 or more makes the line a token longer
    level = replace(LEVELS["full"], column_sum_width=2)
    example = generate_examples(1, seed=3, families=("addition",), level=level, enable_thinking=True)[0]
    a, b = map(int, re.findall(r"\d+", example.messages[-2]["content"]))
    assert example.messages[-1]["reasoning_content"] == addition_working(a, b, column_sum_width=2)
    assert example.expected == f"{a} + {b} = {a + b}"


# ------------------------------------------------------------------------------------------------ tokenizer


def test_special_tokens_are_single_tokens_with_fixed_ids(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    first = VOCAB_SIZE - len(SPECIAL_TOKENS)
    for offset, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == first + offset
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [first + offset]
        assert tokenizer(f"a {token}b", add_special_tokens=False)["input_ids"].count(first + offset) == 1
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == first
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == first + 2
    assert tokenizer.mask_token == "<|mask|>" and tokenizer.mask_token_id == VOCAB_SIZE - 1
    assert tokenizer.padding_side == "left"
    # the markup tokens survive skip_special_tokens, the control tokens do not
    text = "<|im_start|><think>\nx\n</think>\n\n<tool_call>\n</tool_call><|im_end|><|endoftext|>"
    decoded = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    assert decoded == "<think>\nx\n</think>\n\n<tool_call>\n</tool_call>"


def test_digits_are_single_tokens(tokenizer):
    text = "12345 + 67890 = 80235, 0099 x1000"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    for token in tokenizer.convert_ids_to_tokens(ids):
        assert sum(ch.isdigit() for ch in token) <= 1 and not (any(ch.isdigit() for ch in token) and len(token) > 1)


def test_a_quoted_word_is_the_bare_word_after_the_quote(tokenizer):
    """A word takes no quote or bracket into its pre-token (Qwen's pattern would take one), so a quoted word has the
    tokens the same word has at the start of a reply, wherever the quote stands."""
    pre_tokenize = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    assert [piece for piece, _ in pre_tokenize('"lucky ship" (river)')] == [
        '"',
        "lucky",
        "\u0120ship",
        '"',
        "\u0120(",
        "river",
        ")",
    ]
    for word in ("lucky", "river", "garden"):
        bare = tokenizer(word, add_special_tokens=False)["input_ids"]
        for opener in ('"', "'", "(", ':"'):
            quote = tokenizer(opener, add_special_tokens=False)["input_ids"]
            ids = tokenizer(f"{opener}{word} ship", add_special_tokens=False)["input_ids"]
            assert ids[: len(quote) + len(bare)] == quote + bare, (opener, tokenizer.convert_ids_to_tokens(ids))


def test_encode_example_matches_full_rendering(tokenizer):
    for example in _examples_per_kind(seed=11, per_kind=4):
        prompt_ids, answer_ids = encode_example(tokenizer, example, max_length=VOCAB_SIZE)
        kwargs = {"tools": example.tools, "enable_thinking": example.enable_thinking, "return_dict": False}
        full = tokenizer.apply_chat_template(example.messages, **kwargs)
        prompt = tokenizer.apply_chat_template(example.messages[:-1], add_generation_prompt=True, **kwargs)
        assert prompt_ids == prompt
        assert prompt_ids + answer_ids == full[: len(prompt_ids) + len(answer_ids)]
        assert tokenizer.decode(full[len(prompt_ids) + len(answer_ids) :]) == "\n"
        assert answer_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in answer_ids[:-1]
        answer = tokenizer.decode(answer_ids)
        prompt_text = tokenizer.decode(prompt_ids)
        if example.enable_thinking:
            assert prompt_text.endswith("<|im_start|>assistant\n<think>\n")
            assert "\n</think>\n\n" in answer
        else:
            assert prompt_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            assert "<think>" not in answer and "</think>" not in answer
        with pytest.raises(ValueError):
            encode_example(tokenizer, example, max_length=len(prompt_ids) + len(answer_ids) - 1)


def test_checker_accepts_reference_and_rejects_corruption(tokenizer):
    for example in _examples_per_kind(seed=21, per_kind=5):
        reply = _reference_reply(tokenizer, example)
        assert check_reply(example, reply), (example, reply)
        assert check_reply(example, _reference_reply(tokenizer, example, skip_special_tokens=True))
        assert check_reply(example, reply + "<|endoftext|><|endoftext|>")
        if example.enable_thinking:  # the reasoning must be closed
            assert not check_reply(example, reply.replace("</think>", ""))
        if is_tool_call_target(example):
            call = json.loads(example.expected)
            value = str(next(iter(call["arguments"].values())))
            corrupted = reply.replace(f"\n{value}\n", f"\n{value}x\n", 1)
            assert not check_reply(example, reply.replace(f"<function={call['name']}>", "<function=other_tool>"))
            assert not check_reply(
                example,
                reply.replace(
                    "</parameter>\n</function>", "</parameter>\n<parameter=extra>\n1\n</parameter>\n</function>"
                ),
            )
            assert not check_reply(example, reply.replace("<tool_call>", "").replace("</tool_call>", ""))
        else:
            # change the last digit, or the last letter, of the answer
            expected = example.expected
            i = max(i for i, ch in enumerate(expected) if ch.isalnum())
            swapped = (
                {"9": "8"}.get(expected[i], "9") if expected[i].isdigit() else ("a" if expected[i] != "a" else "b")
            )
            corrupted = reply.replace(expected, expected[:i] + swapped + expected[i + 1 :])
            assert not check_reply(example, reply.replace(expected, expected + " extra"))
        assert corrupted != reply and not check_reply(example, corrupted), corrupted
        assert not check_reply(example, "")


# ------------------------------------------------------------------------------------------------ wordings


def _banks():
    """Every (training, held-out) bank of request pieces in demo.wordings."""

    def is_bank(value):
        return isinstance(value, tuple) and len(value) == 2 and all(isinstance(part, tuple) for part in value)

    return [value for value in vars(wordings).values() if is_bank(value)] + list(wordings.TOOL_REQUESTS.values())


def _literal(template: str) -> str:
    """A held-out template's longest fixed stretch of text, lower-cased: what a request worded by it contains."""
    return max(re.split(r"\{[a-z_]+\}", template), key=len).strip(" .?!:,").lower()


def test_training_requests_never_use_a_held_out_wording():
    held_out = {_literal(piece) for _, pieces in _banks() for piece in pieces if len(_literal(piece)) >= 8}
    assert len(held_out) > 40
    for train, pieces in _banks():
        assert not {p for p in pieces if p} & set(train)  # the split is a split
    families = (*FAMILIES, OUT_OF_SCOPE)
    examples = generate_examples(3000, seed=5, families=families, level="wide", wording="train")
    seen = [next(m["content"] for m in e.messages if m["role"] == "user").lower() for e in examples]
    leaked = {phrase for phrase in held_out for text in seen if phrase in text}
    assert not leaked


def test_held_out_wordings_use_only_words_training_has_read():
    """A held-out request is a sentence the model has not read, not a word it has never seen: a model trained from
    scratch on this corpus alone cannot know that an unseen "flip" or "rank" names a task. So every word of a
    held-out addition, sort or reversal template (order phrases included) is in the same family's training pieces."""

    def words(pieces):
        return {
            word for piece in pieces for word in re.findall(r"[a-z']+", re.sub(r"\{[a-z_]+\}", " ", piece.lower()))
        }

    families = {
        "addition": (wordings._ADDITION,),
        "sorting": (wordings._SORT, wordings._SORT_PLAIN, wordings._ASCENDING, wordings._DESCENDING),
        "reversal": (wordings._REVERSAL,),
    }
    for family, banks in families.items():
        unread = words(p for _, held_out in banks for p in held_out) - words(p for train, _ in banks for p in train)
        assert not unread, (family, sorted(unread))


def test_worded_requests_still_carry_the_problem():
    """Whatever the wording, the numbers asked about are in the request and the expected answer is right; requests
    outside the families get the one fixed reply."""
    for wording in ("train", "held_out"):
        examples = generate_examples(
            1000, seed=6, families=(*FAMILIES, OUT_OF_SCOPE), level="wide", wording=wording
        )  # fmt: skip
        for example in examples:
            request = next(m["content"] for m in example.messages if m["role"] == "user")
            if example.family == "addition":
                a, b = map(int, re.findall(r"\d+", request))
                assert example.expected == f"{a} + {b} = {a + b}", request
            elif example.family == "sorting":
                numbers = sorted(map(int, re.findall(r"\d+", request)))
                assert sorted(map(int, example.expected.split(", "))) == numbers, request
            elif example.family == OUT_OF_SCOPE:
                assert example.expected == wordings.OUT_OF_SCOPE_REPLY == example.messages[-1]["content"]
            assert check_reply(example, _reply_text(example)), request
        sizes = {len(str(int(e.expected.split(" + ")[0]))) for e in examples if e.family == "addition"}
        assert {1, 2, 3} <= sizes  # single-digit sums too


def _reply_text(example):
    """The reply the example's target message stands for, as a model would write it."""
    target = example.messages[-1]
    text = f"{target.get('reasoning_content', '')}\n</think>\n\n" if example.enable_thinking else ""
    if target.get("tool_calls"):
        call = target["tool_calls"][0]["function"]
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in call["arguments"].items())
        return text + f"<tool_call>\n<function={call['name']}>\n{body}</function>\n</tool_call>"
    return text + target["content"]


def test_wording_must_be_known():
    with pytest.raises(ValueError, match="Unknown wording 'casual'"):
        make_example("addition", random.Random(0), wording="casual")
