"""Read Clover's replies back into messages: reasoning, visible content and tool calls.

Clover writes the Qwen3.5/3.6 chat format (see `tokenizer_config/chat_template.jinja`). The generation prompt already
opens `<think>`, so a decoded reply usually reads "reasoning...</think>\\n\\ncontent", optionally followed by XML tool
calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Pure Python, so servers and evaluation scripts can use it without torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
# Text after the end of the turn is not part of the reply: block diffusion fills the rest of the last block with pad.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")

# A call may be cut short by max_new_tokens, so each closing tag is optional at the end of the text.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass
class ParsedReply:
    """An assistant reply split into its parts.

    reasoning: the text inside the think block, or None when the reply has none (thinking disabled).
    content: what the user should see, with the reasoning and tool calls removed.
    tool_calls: `{"name": str, "arguments": dict}` per call, in order.
    """

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def to_message(self) -> dict[str, Any]:
        """The reply as an OpenAI-style assistant message, ready to append to the conversation and re-render."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": call} for call in self.tool_calls]
        return message


def parse_parameter_value(text: str) -> Any:
    """A parameter's value: JSON when it parses as JSON (numbers, booleans, objects...), else the string itself.

    The template writes one newline on each side of the value, so exactly one is removed from each side.
    """
    value = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split `text` into the text outside the `<tool_call>` blocks and the calls they hold.

    A block without `<function=...>` is not a call and stays in the text.
    """
    calls: list[dict[str, Any]] = []

    def take_call(match: re.Match[str]) -> str:
        function = _FUNCTION.search(match.group(1))
        if function is None:
            return match.group(0)
        arguments = {
            name.strip(): parse_parameter_value(value) for name, value in _PARAMETER.findall(function.group(2))
        }
        calls.append({"name": function.group(1).strip(), "arguments": arguments})
        return ""

    remaining = _TOOL_CALL.sub(take_call, text)
    return remaining.strip(), calls


def parse_reply(text: str, *, reasoning_open: bool = False) -> ParsedReply:
    """Split a decoded assistant reply into reasoning, content and tool calls.

    `text` is the generated text (decoded with or without special tokens). It may start inside the think block,
    since the generation prompt opened `<think>`, or with its own `<think>`, or have none at all. A reply cut
    off before `</think>` cannot be told apart from a reply without reasoning; pass `reasoning_open=True` (the
    prompt was made with thinking on) to read such a reply as unfinished reasoning rather than as content.
    """
    for token in END_OF_TURN_TOKENS:
        text = text.split(token, 1)[0]
    reasoning = None
    if THINK_END in text:
        reasoning, text = text.split(THINK_END, 1)
    elif text.lstrip().startswith(THINK_START) or reasoning_open:
        reasoning, text = text, ""
    if reasoning is not None:
        reasoning = reasoning.strip().removeprefix(THINK_START).strip()
    content, tool_calls = parse_tool_calls(text)
    return ParsedReply(reasoning=reasoning, content=content, tool_calls=tool_calls)
