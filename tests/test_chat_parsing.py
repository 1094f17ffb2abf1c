"""Chat replies parsed by transformers itself: the tokenizer's `response_template` (the releases that load it, such
as 5.25) for `tokenizer.parse_response` and the text-generation pipeline, and the legacy `response_schema` that
5.2's `parse_response` takes. Both sit in tokenizer_config.json; the shipped model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, pipeline

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "clover-tiny-demo"
THINKING_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
NO_THINKING_PROMPT = THINKING_PROMPT + "\n</think>\n\n"
TOOL_CALL = "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": "3"}}}
# (reply as generated, after which prompt, the parsed message)
REPLIES = {
    "thinking": (
        "It is sunny there.\n</think>\n\nSunny in Paris.<|im_end|>",
        THINKING_PROMPT,
        {"role": "assistant", "reasoning_content": "It is sunny there.", "content": "Sunny in Paris."},
    ),
    "no thinking, padded": (
        "Sunny in Paris.<|im_end|><|endoftext|><|endoftext|>",
        NO_THINKING_PROMPT,
        {"role": "assistant", "content": "Sunny in Paris."},
    ),
    "tool call": (
        "I need the forecast.\n</think>\n\n" + TOOL_CALL + "<|im_end|>",
        THINKING_PROMPT,
        {"role": "assistant", "reasoning_content": "I need the forecast.", "tool_calls": [WEATHER]},
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO, trust_remote_code=True)


def loads_response_templates(tokenizer) -> bool:
    return getattr(tokenizer, "response_template", None) is not None


def test_every_tokenizer_config_carries_the_same_parsers():
    configs = [json.loads(path.read_text()) for path in [REPO / "tokenizer_config" / "tokenizer_config.json", *REPO.glob("models/*/tokenizer_config.json")]]  # fmt: skip
    for key in ("response_template", "response_schema"):
        assert all(config[key] == configs[0][key] for config in configs), key


@pytest.mark.parametrize("case", list(REPLIES))
def test_parse_response_reads_thinking_content_and_tool_calls(tokenizer, case):
    reply, prompt, expected = REPLIES[case]
    if loads_response_templates(tokenizer):
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        assert tokenizer.parse_response(ids, prefix=tokenizer(prompt)["input_ids"]) == expected
        assert tokenizer.parse_response(reply, prefix=prompt) == expected
    else:  # a release without response templates: the legacy schema, on the text the pipeline decodes
        tokenizer.response_schema = json.loads((DEMO / "tokenizer_config.json").read_text())["response_schema"]
        text = tokenizer.decode(tokenizer(reply, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        assert tokenizer.parse_response(text) == expected


def test_the_pipeline_returns_the_reply_parsed(tokenizer):
    if not loads_response_templates(tokenizer):
        pytest.skip("this transformers release does not load response templates; use clover.chat_clover.parse_reply")
    chat = pipeline("text-generation", model=str(DEMO), trust_remote_code=True)
    messages = [{"role": "user", "content": "Sort these numbers in ascending order: 42, 7, 19, 3, 88"}]
    reply = chat(messages, max_new_tokens=96)[0]["generated_text"][-1]
    assert reply == {
        "role": "assistant",
        "reasoning_content": "5 numbers, ascending order: smallest 3, largest 88.",
        "content": "3, 7, 19, 42, 88",
    }
