"""lm-evaluation-harness tasks on the tiny Clover's held-out demo problems: the same problems, rendered by the same
chat template and scored by the same check as `scripts/eval_demo.py` (seed 12345, 50 per family), so the two tools
report the same numbers. The prompt is rendered here (system prompt, tools and thinking mode are per problem), so
run lm_eval without --apply_chat_template."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import datasets
from transformers import AutoTokenizer

from clover.chat_data_clover import chat_prompt_text
from clover.demo.tasks import FAMILIES, check_reply, generate_examples

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "clover-tiny-demo"
SEED, PER_FAMILY = 12345, 50  # scripts/eval_demo.py's defaults


@functools.cache
def _tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


@functools.cache
def _problems(per_family: int, seed: int, thinking: bool | None = None, families: tuple = FAMILIES) -> list:
    return generate_examples(per_family * len(families), seed, families, enable_thinking=thinking)


def _prompt(example) -> str:
    return chat_prompt_text(_tokenizer(), example.to_record())


def held_out_problems(family: str | None = None, per_family: int = PER_FAMILY, seed: int = SEED, **_):
    """The generate_until problems of `family` (all families: None), as eval_demo.py draws them."""
    rows = [
        {"index": i, "per_family": per_family, "seed": seed, "family": e.family, "prompt": _prompt(e),
         "expected": e.expected}
        for i, e in enumerate(_problems(per_family, seed))
        if family in (None, e.family)
    ]  # fmt: skip
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[str]) -> dict:
    example = _problems(doc["per_family"], doc["seed"])[doc["index"]]
    return {"exact_match": float(check_reply(example, results[0]))}


def addition_choices(per_family: int = PER_FAMILY, seed: int = SEED, **_):
    """Loglikelihood problems: a direct addition (thinking off) and four answers, the right one first."""
    rows = []
    for example in _problems(per_family, seed, thinking=False, families=("addition",)):
        a, b, total = (int(x) for x in re.findall(r"\d+", example.expected))
        wrong = [total + 1, total - 1, total + 10, total - 10]
        choices = [f"{a} + {b} = {value}<|im_end|>" for value in [total, *wrong]]
        rows.append({"prompt": _prompt(example), "choices": choices, "label": 0})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
