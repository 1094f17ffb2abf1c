"""Chat data for fine-tuning: JSONL records read with their line numbers, and the one chat encoding training and
evaluation share (`encode_chat_example`)."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Sequence
from pathlib import Path


def read_chat_jsonl(path: str | Path) -> list[dict]:
    """Reads a JSONL file of chat examples: each line `{"messages": [...], "tools": [...]?, "enable_thinking": ?}`
    or `{"prompt": str, "answer": str}`. Raises ValueError naming the line of a malformed record."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg}).") from None
            if not isinstance(record, dict) or not ("messages" in record or {"prompt", "answer"} <= record.keys()):
                raise ValueError(
                    f"{path}:{line_number}: expected an object with 'messages' (a chat ending with the assistant "
                    "reply) or with 'prompt' and 'answer'."
                )
            if "messages" in record:
                messages = record["messages"]
                if not messages or messages[-1].get("role") != "assistant":
                    raise ValueError(f"{path}:{line_number}: the last message must be the assistant reply to learn.")
                last = messages[-1]
                if not (last.get("content") or last.get("tool_calls") or last.get("reasoning_content")):
                    raise ValueError(f"{path}:{line_number}: the assistant reply is empty.")
            elif not str(record["answer"]).strip():
                raise ValueError(f"{path}:{line_number}: the answer is empty.")
            record["_line"] = line_number
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no examples.")
    return records


def chat_prompt_text(tokenizer, record: dict) -> str:
    """What `generate` is given for a chat record: the conversation before its last message, with the generation
    prompt (the record's tools and thinking mode)."""
    return tokenizer.apply_chat_template(
        record["messages"][:-1], tools=record.get("tools"), add_generation_prompt=True,
        enable_thinking=record.get("enable_thinking", True), tokenize=False,
    )  # fmt: skip


def encode_chat_example(tokenizer, record: dict, max_length: int) -> dict[str, list[int]]:
    """(prompt_ids, answer_ids) of a chat record, the one encoding training and evaluation share: the prompt is
    the conversation before the last assistant turn with the generation prompt (what `generate` is given); the
    answer is the rest of the rendered conversation through its `<|im_end|>` (the reply `{% generation %}` marks).
    Both come from one tokenization of the whole conversation, so the answer is exactly what follows the prompt's
    tokens. A `{"prompt", "answer"}` record is plain text split where the caller split it, the answer ending with
    EOS."""
    line = record.get("_line", "?")
    if "messages" in record:
        prompt_text = chat_prompt_text(tokenizer, record)
        full_text = tokenizer.apply_chat_template(
            record["messages"], tools=record.get("tools"), enable_thinking=record.get("enable_thinking", True),
            tokenize=False,
        )  # fmt: skip
        if not full_text.startswith(prompt_text):
            raise ValueError(f"line {line}: the chat template renders the prompt differently inside the conversation.")
        full_text = full_text.rstrip("\n")  # the reply ends at its <|im_end|>, not at the newline after it
    else:  # plain text: the caller's boundary, each side tokenized on its own
        answer_text = record["answer"]
        if tokenizer.eos_token and not answer_text.endswith(tokenizer.eos_token):
            answer_text += tokenizer.eos_token
        prompt_ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        full_ids = prompt_ids + tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        return _within_context({"prompt_ids": prompt_ids, "answer_ids": full_ids[len(prompt_ids) :]}, line, max_length)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"line {line}: the prompt's tokens are not a prefix of the whole conversation's (a merge across the "
            "boundary): end the prompt on a token boundary."
        )
    return _within_context({"prompt_ids": prompt_ids, "answer_ids": full_ids[len(prompt_ids) :]}, line, max_length)


def _within_context(encoded: dict[str, list[int]], line, max_length: int) -> dict[str, list[int]]:
    length = len(encoded["prompt_ids"]) + len(encoded["answer_ids"])
    if length > max_length:
        raise ValueError(
            f"line {line}: the example has {length} tokens, more than the context of {max_length}; shorten it or "
            "raise --max-length."
        )
    return encoded


def encode_chat_examples(
    tokenizer, records: Sequence[dict], max_length: int, processes: int | None = None
) -> list[dict]:
    """`encode_chat_example` of every record, in order, over `processes` worker processes (default: one per CPU):
    rendering the chat template dominates the time of a large corpus."""
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(records) < 2000:
        return [encode_chat_example(tokenizer, record, max_length) for record in records]
    context = multiprocessing.get_context("fork")  # the workers inherit the tokenizer instead of unpickling it
    with context.Pool(processes, initializer=_set_encoding, initargs=(tokenizer, max_length)) as pool:
        return pool.map(_encode_in_worker, records, chunksize=500)


_ENCODING: tuple = ()


def _set_encoding(tokenizer, max_length: int) -> None:
    global _ENCODING
    _ENCODING = (tokenizer, max_length)


def _encode_in_worker(record: dict) -> dict:
    tokenizer, max_length = _ENCODING
    return encode_chat_example(tokenizer, record, max_length)


__all__ = ["chat_prompt_text", "encode_chat_example", "encode_chat_examples", "read_chat_jsonl"]
