"""Exact-match accuracy and tokens per forward of a demo model on held-out problems.

    python scripts/eval_demo.py                                   # the shipped Clover, 50 problems per family
    python scripts/eval_demo.py --model models/qwen3_5_moe-tiny-demo    # its autoregressive base, same problems
    python scripts/eval_demo.py --self-speculative                # and Clover's lossless self-speculative mode
    python scripts/eval_demo.py --sample                          # and Qwen's recommended sampling at 0.95
    python scripts/eval_demo.py --model DIR --per-family 100 --output eval_results

A Clover checkpoint is decoded by block diffusion at each threshold (and, with --self-speculative, by
`generate(strategy="self_speculative")`: its own causal greedy output, drafted by block diffusion); any other causal
LM (the demo's Qwen3.5-MoE base) by its own greedy `generate`, one token per forward. Prints a table (accuracy per
family and overall, tokens per forward) and writes eval_demo.json and eval_demo.png. The problems come from a seed
training never used.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover.cli_clover import checkpoint_dir, repository_label, run_main
from clover.demo_tasks import FAMILIES, check_reply, encode_example, generate_examples

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "clover-tiny-demo"
THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7)
SELF_SPECULATIVE = "self_speculative"
# Qwen3.5's recommended sampling for thinking mode, at the default threshold (--sample).
SAMPLED = "sampled@0.95"
RECOMMENDED_SAMPLING = {"threshold": 0.95, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
# The two kinds of addition: 2-3 digit operands answered at once (thinking off), 3-6 digits worked out column by
# column (thinking on). Reported apart, not counted again in "all".
ADDITION_KINDS = {False: "addition_direct", True: "addition_worked"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--per-family", type=int, default=50)
    parser.add_argument(
        "--seed", type=int, default=12345, help="held-out seed (the training corpora use seeds below 40)"
    )
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=list(THRESHOLDS), help="Clover's LowConfidence thresholds"
    )
    parser.add_argument(
        "--self-speculative", action="store_true", help="also decode a Clover checkpoint self-speculatively"
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="also decode a Clover checkpoint at 0.95 with temperature 0.6, top_p 0.95, top_k 20 (seeded by --seed)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--output", default="eval_results")
    return parser.parse_args(argv)


def is_clover(model) -> bool:
    return model.config.model_type == "clover"


@torch.no_grad()
def evaluate(model, tokenizer, examples, decoding: float | str | None, batch_size: int, max_new_tokens: int) -> dict:
    """Greedy decoding of the examples (for Clover block diffusion at threshold `decoding`, or "self_speculative";
    else the model's own AR `generate`); per family: correct count, new tokens (through EOS), forwards. The
    additions are also counted apart by kind (`ADDITION_KINDS`)."""
    encoded = [encode_example(tokenizer, e, model.config.max_position_embeddings)[0] for e in examples]
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
            if family == "addition":
                kind = ADDITION_KINDS[examples[i].enable_thinking]
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


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = sorted((key for key in results if key not in (SELF_SPECULATIVE, SAMPLED)), key=float, reverse=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for family in [*FAMILIES, "all"]:
        left.plot(
            [float(t) for t in thresholds],
            [100 * results[t]["accuracy"][family] for t in thresholds],
            marker="o",
            lw=2.5 if family == "all" else 1,
            label=family,
        )
    left.set_xlabel("threshold")
    left.set_ylabel("exact match (%)")
    left.invert_xaxis()
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.plot([float(t) for t in thresholds], [results[t]["tokens_per_forward"] for t in thresholds], marker="o")
    right.set_xlabel("threshold")
    right.set_ylabel("tokens per forward")
    right.invert_xaxis()
    right.grid(alpha=0.3)
    fig.suptitle("Tiny Clover demo: accuracy and parallelism vs. the LowConfidence threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.per_family < 1:
        raise ValueError(f"--per-family ({args.per_family}) must be at least 1.")
    torch.set_grad_enabled(False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(args.model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    examples = generate_examples(args.per_family * len(FAMILIES), seed=args.seed)
    results = {}
    for flag, asked in (("--self-speculative", args.self_speculative), ("--sample", args.sample)):
        if asked and not is_clover(model):
            raise ValueError(f"{flag} needs a Clover checkpoint; {args.model} is a {model.config.model_type}.")
    if is_clover(model):
        extra = [SELF_SPECULATIVE] * args.self_speculative + [SAMPLED] * args.sample
        decodings = [*args.thresholds, *extra]
    else:
        decodings = [None]  # its own autoregressive generate
    for decoding in tqdm(decodings, desc="runs"):
        start = time.perf_counter()
        torch.manual_seed(args.seed)  # the sampled run draws from torch's global generator
        stats = evaluate(model, tokenizer, examples, decoding, args.batch_size, args.max_new_tokens)
        results[str(decoding or "AR")] = summarise(stats) | {"seconds": round(time.perf_counter() - start, 1)}

    header = f"{'decoding':>16} | " + " | ".join(f"{f:>9}" for f in FAMILIES) + " |       all | tok/fwd"
    print(header)
    print("-" * len(header))
    for decoding, result in results.items():
        accuracy = result["accuracy"]
        cells = " | ".join(f"{100 * accuracy[f]:8.1f}%" for f in FAMILIES)
        print(f"{decoding:>16} | {cells} | {100 * accuracy['all']:8.1f}% | {result['tokens_per_forward']:7.2f}")
    kinds = [kind for kind in ADDITION_KINDS.values() if kind in next(iter(results.values()))["counts"]]
    if kinds:
        print("additions by kind (direct: 2-3 digits, thinking off; worked: 3-6 digits, column by column):")
        for decoding, result in results.items():
            counts = result["counts"]
            cells = ", ".join(f"{k.split('_')[1]} {counts[k]['correct']}/{counts[k]['total']}" for k in kinds)
            print(f"{decoding:>16} | {cells}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": repository_label(args.model),
        "per_family": args.per_family,
        "seed": args.seed,
        "results": results,
    }
    (output / "eval_demo.json").write_text(json.dumps(payload, indent=1))
    written = [output / "eval_demo.json"]
    thresholds_run = [key for key in results if key not in ("AR", SELF_SPECULATIVE, SAMPLED)]
    if thresholds_run:
        try:
            plot(results, output / "eval_demo.png")
            written.append(output / "eval_demo.png")
        except ImportError:  # matplotlib comes with the "train" and "test" extras, not the plain install
            print("no plot: matplotlib is not installed (pip install matplotlib)")
    print("wrote " + " and ".join(str(path) for path in written))


if __name__ == "__main__":
    run_main(main)
