"""Exact-match accuracy and tokens per forward of a demo model on held-out problems.

    python scripts/eval_demo.py                                   # the shipped Clover, 50 problems per family
    python scripts/eval_demo.py --model models/qwen3_5_moe-tiny-demo    # its autoregressive base, same problems
    python scripts/eval_demo.py --self-speculative                # and Clover's lossless self-speculative mode
    python scripts/eval_demo.py --sample                          # and Qwen's recommended sampling at 0.95
    python scripts/eval_demo.py --problems demo/own_wordings.jsonl   # requests worded apart from the generator
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
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover.cli_clover import checkpoint_dir, repository_label, run_main
from clover.demo.evaluation import (
    ADDITION_KINDS,
    SAMPLED,
    SELF_SPECULATIVE,
    THINKING_MODES,
    evaluate,
    is_clover,
    summarise,
)
from clover.demo.tasks import FAMILIES, generate_examples, read_problems

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "clover-tiny-demo"
THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7)


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
    parser.add_argument(
        "--problems", default=None, help="a JSONL of problems to score instead of the generated ones (read_problems)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--output", default="eval_results")
    return parser.parse_args(argv)


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
    if args.problems:
        examples = read_problems(args.problems)
    else:
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
    groups = {
        "additions by kind (direct: 2-3 digits, thinking off; worked: 3-6 digits, column by column):": ADDITION_KINDS,
        "every family by thinking mode:": THINKING_MODES,
    }
    for title, names in groups.items():
        kinds = [kind for kind in names.values() if kind in next(iter(results.values()))["counts"]]
        if kinds:
            print(title)
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
        "problems": args.problems,  # a problem file, or None: the generated ones (seed, per_family)
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
