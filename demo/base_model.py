"""The autoregressive base's batches (the first stage of the demo: next-token loss on the answers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..training_clover import unpack_batch


@dataclass
class CausalChatCollator:
    """Collates `{"prompt_ids", "answer_ids"}` features into a next-token training batch for an autoregressive model
    (the demo's Qwen3.5-MoE base): prompt + answer right-padded, labels on the answer only (the model shifts them).

    Right padding keeps every row's positions those it has alone (transformers' Qwen3.5-MoE counts positions from
    the first column), and padding after the answer is never seen by the answer's own tokens.
    """

    pad_token_id: int

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        features = unpack_batch(features)
        length = max(len(f["prompt_ids"]) + len(f["answer_ids"]) for f in features)
        input_ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        for row, feature in enumerate(features):
            prompt, answer = list(feature["prompt_ids"]), list(feature["answer_ids"])
            input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            attention_mask[row, : len(prompt) + len(answer)] = 1
            labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


__all__ = ["CausalChatCollator"]
