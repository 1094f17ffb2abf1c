"""Scoring a demo model on held-out problems (what `scripts/eval_demo.py` and the `clover_demo` lm-eval tasks
report): greedy block diffusion at a threshold, Clover's self-speculative mode, Qwen's recommended sampling, or a
causal LM's own `generate`; exact match per family (`check_reply`) and tokens per forward."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..chat_data_clover import chat_prompt_text
from .tasks import FAMILIES, check_reply, data_position

SELF_SPECULATIVE = "self_speculative"
# Qwen3.5's recommended sampling for thinking mode, at the default threshold (--sample).
SAMPLED = "sampled@0.95"
RECOMMENDED_SAMPLING = {"threshold": 0.95, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
# The two kinds of addition: 2-3 digit operands answered at once (thinking off), 3-6 digits worked out column by
# column (thinking on). Reported apart, not counted again in "all".
ADDITION_KINDS = {False: "addition_direct", True: "addition_worked"}
# The families counted again by thinking mode, together and one by one ("addition/thinking_on"), apart from "all".
THINKING_MODES = {False: "thinking_off", True: "thinking_on"}


def is_clover(model) -> bool:
    return model.config.model_type == "clover"


@torch.no_grad()
def evaluate(model, tokenizer, examples, decoding: float | str | None, batch_size: int, max_new_tokens: int) -> dict:
    """Greedy decoding of the examples (for Clover block diffusion at threshold `decoding`, or "self_speculative";
    else the model's own AR `generate`); per family: correct count, new tokens (through EOS), forwards. The
    families are also counted by thinking mode, the additions by kind (`ADDITION_KINDS`), and the additions, sorts
    and reversals by where their data stand in the request (`demo.tasks.data_position`)."""
    # The prompt alone: a reply is scored on its text, so the target's own rendering plays no part.
    encoded = [tokenizer(chat_prompt_text(tokenizer, e.to_record()), add_special_tokens=False)["input_ids"] for e in examples]  # fmt: skip
    order = sorted(range(len(examples)), key=lambda i: len(encoded[i]))  # similar lengths share a batch
    eos_ids = torch.tensor(model.generation_config.eos_token_id).reshape(-1)
    stats = defaultdict(lambda: {"correct": 0, "total": 0, "new_tokens": 0, "forwards": 0})
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, padding=True, return_tensors="pt")
        new, forwards = generate(model, batch, decoding, max_new_tokens, eos_ids)
        for j, i in enumerate(rows):
            reply = tokenizer.decode(new[j, : int(forwards["new"][j])], skip_special_tokens=True)
            family, right = examples[i].family, int(check_reply(examples[i], reply))
            stats[family]["total"] += 1
            stats[family]["correct"] += right
            stats[family]["new_tokens"] += int(forwards["new"][j])
            stats[family]["forwards"] += int(forwards["forwards"][j])
            mode = THINKING_MODES[examples[i].enable_thinking]
            kinds = [f"{family}/{mode}"] + [mode] * (family in FAMILIES)
            if family == "addition":
                kinds.append(ADDITION_KINDS[examples[i].enable_thinking])
            if position := data_position(examples[i]):
                kinds += [f"{family}/{position}", position]
            for kind in kinds:
                stats[kind]["total"] += 1
                stats[kind]["correct"] += right
    return dict(stats)


def generate(model, batch, decoding, max_new_tokens, eos_ids) -> tuple[torch.Tensor, dict]:
    """(new tokens (batch, n), {"new": tokens through EOS per row, "forwards": forwards per row})."""
    prompt_len = batch["input_ids"].shape[1]
    if is_clover(model):
        if decoding == SELF_SPECULATIVE:
            how = {"strategy": decoding, "do_sample": False}
        elif decoding == SAMPLED:
            how = RECOMMENDED_SAMPLING
        else:
            how = {"threshold": decoding, "do_sample": False}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **how)
        new = out.sequences[:, prompt_len:]
        return new, {"new": out.num_new_tokens, "forwards": out.num_forward_passes}
    new = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)[:, prompt_len:]
    is_eos = torch.isin(new, eos_ids)
    through_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, new.shape[1])
    return new, {"new": through_eos, "forwards": through_eos}  # one token per forward


def summarise(stats: dict) -> dict:
    families = [s for f, s in stats.items() if f in FAMILIES]
    total = {k: sum(s[k] for s in families) for k in ("correct", "total", "new_tokens", "forwards")}
    return {
        "accuracy": {f: s["correct"] / s["total"] for f, s in stats.items()}
        | {"all": total["correct"] / total["total"]},
        "tokens_per_forward": total["new_tokens"] / max(total["forwards"], 1),
        "counts": stats,
    }


__all__ = [
    "ADDITION_KINDS",
    "RECOMMENDED_SAMPLING",
    "SAMPLED",
    "SELF_SPECULATIVE",
    "evaluate",
    "is_clover",
    "summarise",
]
