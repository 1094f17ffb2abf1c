"""The demo problems decoded on llama.cpp (`llama_cpp_clover`) beside transformers' `generate`: per strategy, the
share of problems on which both give the same tokens, each one's exact match, tokens per forward and speed
(`scripts/eval_llama_cpp.py`, `tests/test_llama_cpp.py`, the benchmark's llama.cpp rows)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..chat_data_clover import chat_prompt_text
from .tasks import check_reply

# What each strategy name asks of transformers' generate and of LlamaCppClover.generate.
STRATEGIES = {
    "low_confidence": {"strategy": "low_confidence"},
    "self_speculative": {"strategy": "self_speculative"},
}


@dataclass
class Decoded:
    """One problem's new tokens (through EOS), forwards and seconds."""

    tokens: list[int]
    forwards: int
    seconds: float


def prompt_ids(tokenizer, examples) -> list[list[int]]:
    """The prompts as evaluation encodes them (the chat template's generation prompt, no special tokens added)."""
    return [tokenizer(chat_prompt_text(tokenizer, e.to_record()), add_special_tokens=False)["input_ids"] for e in examples]  # fmt: skip


@torch.no_grad()
def decode_transformers(model, prompts, strategy: str, max_new_tokens: int, threshold: float = 0.95) -> list[Decoded]:
    """Each prompt alone through `model.generate` (greedy), as the reference."""
    results = []
    for ids in prompts:
        start = time.perf_counter()
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, threshold=threshold, do_sample=False,
            return_dict_in_generate=True, **STRATEGIES[strategy],
        )  # fmt: skip
        seconds = time.perf_counter() - start
        new = out.sequences[0, len(ids) : len(ids) + int(out.num_new_tokens[0])].tolist()
        results.append(Decoded(new, int(out.num_forward_passes[0]), seconds))
    return results


def decode_llama_cpp(model, prompts, strategy: str, max_new_tokens: int, threshold: float = 0.95) -> list[Decoded]:
    """Each prompt through `LlamaCppClover.generate` (greedy); `strategy` may also be "autoregressive"."""
    results = []
    for ids in prompts:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, strategy=strategy, threshold=threshold)
        results.append(Decoded(out.tokens, out.num_forward_passes, time.perf_counter() - start))
    return results


def score(tokenizer, examples, decoded: list[Decoded]) -> dict:
    """Exact match, tokens per forward and tokens per second of a list of decoded replies."""
    correct = sum(
        check_reply(e, tokenizer.decode(d.tokens, skip_special_tokens=True))
        for e, d in zip(examples, decoded, strict=True)
    )
    tokens = sum(len(d.tokens) for d in decoded)
    return {
        "exact_match": correct / len(examples),
        "tokens_per_forward": tokens / max(sum(d.forwards for d in decoded), 1),
        "tokens_per_second": tokens / max(sum(d.seconds for d in decoded), 1e-9),
        "new_tokens": tokens,
    }


def agreement(reference: list[Decoded], other: list[Decoded]) -> float:
    """The share of problems on which both decodings give exactly the same new tokens."""
    return sum(a.tokens == b.tokens for a, b in zip(reference, other, strict=True)) / len(reference)


__all__ = ["STRATEGIES", "Decoded", "agreement", "decode_llama_cpp", "decode_transformers", "prompt_ids", "score"]
