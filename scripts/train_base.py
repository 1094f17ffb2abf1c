"""Fine-tunes the demo's autoregressive base (a plain Qwen3.5-MoE checkpoint) on a chat JSONL with next-token loss,
by transformers.Trainer: the causal counterpart of scripts/train.py, so that a base and the Clover made from it
learn the same data and stay comparable.

    python scripts/train_base.py --model models/qwen3_5_moe-tiny-demo --data train.jsonl --output my-base \\
        --max-steps 1200 --lr 3e-4 --checkpoint-dir runs/my-base      # resumable: rerun to continue
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from clover.cli_clover import checkpoint_dir, run_main
from clover.demo.base_model import train_base


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an autoregressive checkpoint directory")
    parser.add_argument("--data", required=True, help="JSONL of chat examples (as scripts/train.py reads)")
    parser.add_argument("--eval-data", default=None, help="JSONL for a periodic eval loss")
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--batch-tokens", type=int, default=4096, help="batches of similar length up to this many tokens"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, help="Trainer checkpoints; a rerun resumes from the newest")
    parser.add_argument("--save-steps", type=int, default=150)
    parser.add_argument("--logging-steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="replace an existing --output")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    checkpoint_dir(args.model)
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data}: no such file; pass a JSONL of chat examples.")
    if Path(args.output).exists() and not args.force:
        raise ValueError(f"{args.output} exists; pass --force to replace it (it is kept until the new one is saved).")
    if args.max_steps < 1:
        raise ValueError(f"--max-steps ({args.max_steps}) must be at least 1.")
    if args.threads:
        torch.set_num_threads(args.threads)
    train_base(
        args.model, args.data, args.output, eval_data=args.eval_data, max_steps=args.max_steps, lr=args.lr,
        batch_tokens=args.batch_tokens, seed=args.seed, checkpoint_dir=args.checkpoint_dir, save_steps=args.save_steps, logging_steps=args.logging_steps,
    )  # fmt: skip
    print(f"saved {args.output}")


if __name__ == "__main__":
    run_main(main)
