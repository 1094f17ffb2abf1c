"""Clover against its autoregressive base at equal accuracy, measured in one run on the same held-out problems.

    python scripts/bench.py                                      # the shipped Clover and its AR base, CPU
    python scripts/bench.py --per-family 10 --output bench_results

1. Decoding, batch 1, greedy, each model its own way, on held-out demo problems: the AR base with transformers'
   `Qwen3_5MoeForCausalLM.generate` (KV cache), at the machine's thread count and at one thread (a one-token
   forward gains little from a second thread; the speed ratios are against the faster of the two); Clover
   LowConfidence at thresholds 1.0 / 0.95 / 0.9 / 0.8 / 0.7;
   Clover self-speculative (drafts by block diffusion, verified by the causal forward), also with drafts capped
   at --draft-steps denoising steps. For each: tokens/s, tokens per forward, exact match.
2. Where a denoising step's time goes (attention, Gated DeltaNet, routed experts, the rest of the MoE, lm_head,
   the rest), on the shipped model and on a slice of the real 35B shape (one Gated DeltaNet and one attention
   layer, 256 experts, the 248,320-token vocabulary, bf16).
3. Time per denoising step against prompt length (128 to 8192 tokens); loop overhead (generate's wall time over the
   time inside the network: the trunk's forwards and the lm_head projections; over the trunk alone, too); forwards
   per block against denoising steps per block.
4. With --llama-cpp TYPE: the same Clover exported to a GGUF of that type (scripts/export_gguf.py) and decoded on
   llama.cpp in the same run, on the same problems: llama.cpp's own AR decoding of that file, block diffusion at
   0.95, self-speculative (llama_cpp_clover); their speed against that AR decoding.
Prints the tables, writes bench.json and bench.png (exact match against tokens/s, the AR base as a point).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clover.cli_clover import run_main
from clover.demo.bench import DRAFT_STEPS, PROMPT_LENGTHS, THRESHOLDS, run_bench

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "clover-tiny-demo"), help="a Clover checkpoint")
    parser.add_argument(
        "--base", default=str(REPO / "models" / "qwen3_5_moe-tiny-demo"), help="its autoregressive base"
    )
    parser.add_argument("--per-family", type=int, default=6, help="held-out problems per task family")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument(
        "--draft-steps",
        type=int,
        nargs="*",
        default=list(DRAFT_STEPS),
        help="self-speculative runs with drafts capped at N steps",
    )
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=list(PROMPT_LENGTHS))
    parser.add_argument("--steps", type=int, default=10, help="timed denoising steps per prompt length")
    parser.add_argument("--no-35b-slice", action="store_true", help="skip the profile of the 35B-shaped slice")
    parser.add_argument(
        "--llama-cpp", default=None, metavar="TYPE", help="also decode on llama.cpp from a GGUF of TYPE, e.g. f32"
    )
    parser.add_argument("--output", default="bench_results")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_bench(
        args.model,
        args.base,
        args.output,
        per_family=args.per_family,
        thresholds=args.thresholds,
        draft_steps=args.draft_steps,
        max_new_tokens=args.max_new_tokens,
        prompt_lengths=args.prompt_lengths,
        steps=args.steps,
        slice_35b=not args.no_35b_slice,
        llama_cpp=args.llama_cpp,
    )


if __name__ == "__main__":
    run_main(main)
