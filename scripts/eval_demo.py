"""Exact-match accuracy and tokens per forward of a demo model on held-out problems, worded as the training
templates word them and worded as training never saw.

    python scripts/eval_demo.py                                   # the shipped Clover, 50 problems per family
    python scripts/eval_demo.py --model models/qwen3_5_moe-tiny-demo    # its autoregressive base, same problems
    python scripts/eval_demo.py --self-speculative                # and Clover's lossless self-speculative mode
    python scripts/eval_demo.py --sample                          # and Qwen's recommended sampling at 0.95
    python scripts/eval_demo.py --problems demo/own_wordings.jsonl   # requests worded apart from the generator
    python scripts/eval_demo.py --model DIR --per-family 100 --output eval_results

A Clover checkpoint is decoded by block diffusion at each threshold (and, with --self-speculative, by
`generate(strategy="self_speculative")`: its own causal greedy output, drafted by block diffusion); any other causal
LM (the demo's Qwen3.5-MoE base) by its own greedy `generate`, one token per forward. The problems come from a seed
training never used, in two sets (--wordings): "templates", the original request templates at the evaluated sizes,
and "held_out", requests composed from the held-out part of the wording bank (`demo.wordings`: templates, order
words and politeness training never saw) at every size, with requests outside the families (which get one fixed
reply). `--wordings train` adds fresh problems worded by the bank's training part, composed the same way: whether a
model has learnt the wordings it was trained on at all, apart from generalising to new ones. Prints a table per set
(accuracy per family and overall, tokens per forward; "all" counts the four families), then each family by thinking
mode and, where some requests have words after their data, the additions, sorts and reversals by where their data
stand (a model that finds its data by their distance from the end of the request fails those), and writes
eval_demo.json and eval_demo.png.
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
from clover.demo.tasks import DATA_POSITIONS, FAMILIES, OUT_OF_SCOPE, WORDINGS, generate_examples, read_problems
from clover.demo.wordings import SPLITS

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "clover-tiny-demo"
THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7)
DEFAULT_WORDING_SETS = ("templates", "held_out")


def problem_sets(args) -> dict[str, list]:
    """The problems to score, by set name."""
    if args.problems:
        return {Path(args.problems).stem: read_problems(args.problems)}
    sets = {}
    if "templates" in args.wordings:  # the sizes the targets are set on, as earlier results were measured
        sets["templates"] = generate_examples(args.per_family * len(FAMILIES), seed=args.seed)
    families = (*FAMILIES, OUT_OF_SCOPE)
    for wording in SPLITS:  # the wording bank's parts
        if wording in args.wordings:
            sets[wording] = generate_examples(
                args.per_family * len(families), seed=args.seed, families=families, level="wide", wording=wording
            )
    return sets


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--per-family", type=int, default=50)
    parser.add_argument("--seed", type=int, default=12345, help="held-out seed (no training corpus uses it)")
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
        "--wordings",
        nargs="+",
        choices=WORDINGS,
        default=list(DEFAULT_WORDING_SETS),
        help="the problem sets: the original templates' wordings, the bank's held-out wordings (default: both), "
        "the bank's training wordings",
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


def print_tables(name: str, results: dict) -> None:
    """One problem set: accuracy per family and tokens per forward per decoding, then the breakdowns."""
    counts = next(iter(results.values()))["counts"]
    columns = [f for f in (*FAMILIES, OUT_OF_SCOPE) if f in counts]
    print(f"\n{name} ({sum(counts[f]['total'] for f in columns)} problems)")
    header = f"{'decoding':>16} | " + " | ".join(f"{f[:9]:>9}" for f in columns) + " |       all | tok/fwd"
    print(header)
    print("-" * len(header))
    for decoding, result in results.items():
        accuracy = result["accuracy"]
        cells = " | ".join(f"{100 * accuracy[f]:8.1f}%" for f in columns)
        print(f"{decoding:>16} | {cells} | {100 * accuracy['all']:8.1f}% | {result['tokens_per_forward']:7.2f}")
    kinds = [kind for kind in ADDITION_KINDS.values() if kind in counts]
    if kinds:
        print("additions by kind (direct: answered at once, thinking off; worked: column by column, thinking on):")
        for decoding, result in results.items():
            cells = ", ".join(f"{k.split('_')[1]} {result['counts'][k]['correct']}/{result['counts'][k]['total']}" for k in kinds)  # fmt: skip
            print(f"{decoding:>16} | {cells}")
    if DATA_POSITIONS[1] in counts:
        print_split(
            "by where the data stand (last in the request / words after them):", results, columns, *DATA_POSITIONS
        )
    print_split("by thinking mode (on / off):", results, columns, THINKING_MODES[True], THINKING_MODES[False])


def print_split(title: str, results: dict, columns: list[str], first: str, second: str) -> None:
    """Each family's right/total under two counts of `evaluate` ("addition/thinking_on", ...), and over all."""
    print(title)
    for decoding, result in results.items():
        share = {key: f"{c['correct']}/{c['total']}" for key, c in result["counts"].items()}
        cells = ", ".join(
            f"{f} {share.get(f'{f}/{first}', '-')} {share.get(f'{f}/{second}', '-')}"
            for f in columns
            if f"{f}/{first}" in share or f"{f}/{second}" in share
        )
        print(f"{decoding:>16} | {cells} | all {share.get(first, '-')} {share.get(second, '-')}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.per_family < 1:
        raise ValueError(f"--per-family ({args.per_family}) must be at least 1.")
    torch.set_grad_enabled(False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(args.model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    sets = problem_sets(args)
    for flag, asked in (("--self-speculative", args.self_speculative), ("--sample", args.sample)):
        if asked and not is_clover(model):
            raise ValueError(f"{flag} needs a Clover checkpoint; {args.model} is a {model.config.model_type}.")
    if is_clover(model):
        extra = [SELF_SPECULATIVE] * args.self_speculative + [SAMPLED] * args.sample
        decodings = [*args.thresholds, *extra]
    else:
        decodings = [None]  # its own autoregressive generate
    results = {name: {} for name in sets}
    for name, decoding in tqdm([(n, d) for n in sets for d in decodings], desc="runs"):
        start = time.perf_counter()
        torch.manual_seed(args.seed)  # the sampled run draws from torch's global generator
        stats = evaluate(model, tokenizer, sets[name], decoding, args.batch_size, args.max_new_tokens)
        results[name][str(decoding or "AR")] = summarise(stats) | {"seconds": round(time.perf_counter() - start, 1)}
    for name, by_decoding in results.items():
        print_tables(name, by_decoding)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": repository_label(args.model),
        "per_family": args.per_family,
        "seed": args.seed,
        "problems": args.problems,  # a problem file, or None: the generated ones (seed, per_family)
        "results": results,  # per problem set, per decoding
    }
    (output / "eval_demo.json").write_text(json.dumps(payload, indent=1))
    written = [output / "eval_demo.json"]
    first = next(iter(results.values()))
    thresholds_run = [key for key in first if key not in ("AR", SELF_SPECULATIVE, SAMPLED)]
    if thresholds_run:
        try:
            plot(first, output / "eval_demo.png")
            written.append(output / "eval_demo.png")
        except ImportError:  # matplotlib comes with the "train" and "test" extras, not the plain install
            print("no plot: matplotlib is not installed (pip install matplotlib)")
    print("wrote " + " and ".join(str(path) for path in written))


if __name__ == "__main__":
    run_main(main)
