"""Fine-tuning Clover with the block-diffusion objective: batches for `model(**batch)` and `transformers.Trainer`.

A batch lines up every row's answer at the same column (prompts left-padded), splits the answers into blocks of
`block_size` (right-padded to whole blocks) and draws the noise from a seeded generator:

    input_ids   [pad pad p p p | a a a a a a eos pad | ...]
    block_ids   [ -1  -1 -1 -1 -1 |  0 0 0 0  1 1  1   1 | ...]
    labels      [-100 ...          |  a a a a  a a eos pad]   (pad after EOS is supervised up to the block end,
                                                               so the model learns that a finished row stays pad)
    noise_mask  which supervised tokens become <|mask|>, at a rate t ~ U(eps, 1) drawn per block
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .modeling_clover import draw_block_noise


@dataclass
class CloverDataCollator:
    """Collates `{"prompt_ids": [...], "answer_ids": [...]}` features into a block-diffusion training batch.

    Args:
        pad_token_id: id used for padding (and supervised after the answer's EOS up to its block end).
        block_size: the model's `config.block_size`.
        seed: seeds the noise generator, so a run is reproducible.
        complementary: also train every example with the complement of its mask (rate 1 - t): each token is
            then seen masked exactly once per pair, which lowers the variance of the loss.
        eps: the smallest noise level.
    """

    pad_token_id: int
    block_size: int
    seed: int = 0
    complementary: bool = False
    eps: float = 1e-3

    def __post_init__(self):
        self.generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        for i, feature in enumerate(features):
            if len(feature["prompt_ids"]) == 0:
                raise ValueError(f"Example {i} has an empty prompt; block diffusion conditions on a prompt.")
            if len(feature["answer_ids"]) == 0:
                raise ValueError(f"Example {i} has an empty answer: there is nothing to learn from it.")
        bs = self.block_size
        prompt_len = max(len(f["prompt_ids"]) for f in features)
        num_blocks = max(-(-len(f["answer_ids"]) // bs) for f in features)
        answer_len = num_blocks * bs
        batch = len(features)

        input_ids = torch.full((batch, prompt_len + answer_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        for row, feature in enumerate(features):
            prompt, answer = list(feature["prompt_ids"]), list(feature["answer_ids"])
            input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
            attention_mask[row, prompt_len - len(prompt) :] = 1
            supervised_len = -(-len(answer) // bs) * bs  # through the end of the answer's last block
            input_ids[row, prompt_len : prompt_len + len(answer)] = torch.tensor(answer)
            labels[row, prompt_len : prompt_len + supervised_len] = input_ids[row, prompt_len : prompt_len + supervised_len]  # fmt: skip
        block_ids = torch.full_like(input_ids, -1)
        block_ids[:, prompt_len:] = torch.arange(answer_len) // bs

        noise_mask, noise_level = draw_block_noise(labels != -100, block_ids, bs, self.generator, self.eps)
        batch_out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "block_ids": block_ids,
            "noise_mask": noise_mask,
            "noise_level": noise_level,
        }
        if self.complementary:
            complement = (labels != -100) & ~noise_mask
            complement_level = torch.where(block_ids >= 0, (1 - noise_level).clamp(min=self.eps), noise_level)
            batch_out = {key: torch.cat([value, value]) for key, value in batch_out.items()}
            batch_out["noise_mask"] = torch.cat([noise_mask, complement])
            batch_out["noise_level"] = torch.cat([noise_level, complement_level])
        return batch_out


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


def encode_chat_example(tokenizer, record: dict, max_length: int) -> dict[str, list[int]]:
    """(prompt_ids, answer_ids) of a chat record: the prompt is the conversation before the last assistant turn
    with the generation prompt; the answer is the rest of the rendered conversation, through `<|im_end|>`."""
    line = record.get("_line", "?")
    if "messages" in record:
        messages, tools = record["messages"], record.get("tools")
        thinking = record.get("enable_thinking", True)
        prompt_text = tokenizer.apply_chat_template(
            messages[:-1], tools=tools, add_generation_prompt=True, enable_thinking=thinking, tokenize=False
        )
        full_text = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise ValueError(f"line {line}: the chat template renders the prompt differently inside the conversation.")
        answer_text = full_text[len(prompt_text) :].rstrip("\n")
    else:
        prompt_text, answer_text = record["prompt"], record["answer"]
        if tokenizer.eos_token and not answer_text.endswith(tokenizer.eos_token):
            answer_text += tokenizer.eos_token
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    if len(prompt_ids) + len(answer_ids) > max_length:
        raise ValueError(
            f"line {line}: the example has {len(prompt_ids) + len(answer_ids)} tokens, more than the context of "
            f"{max_length}; shorten it or raise --max-length."
        )
    return {"prompt_ids": prompt_ids, "answer_ids": answer_ids}


__all__ = ["CloverDataCollator", "encode_chat_example", "read_chat_jsonl"]
