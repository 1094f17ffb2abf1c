"""Fine-tunes a Clover checkpoint on a JSONL of chat examples with the block-diffusion objective.

    python scripts/train.py --model models/clover-tiny-demo --data train.jsonl --output my-clover
    python scripts/train.py --model DIR --data train.jsonl --output my-clover --lora 16 --epochs 3
    python scripts/train.py ... --checkpoint-dir runs/my-clover --save-steps 200     # resumable: rerun to continue
    python scripts/train.py ... --push-to-hub user/my-clover

Each line: {"messages": [... ending with the assistant reply], "tools": [...]?, "enable_thinking": true?} or
{"prompt": "...", "answer": "..."}. Uses transformers.Trainer (progress bar, periodic eval on --eval-data or a
held-out 5%), then saves with save_pretrained (LoRA adapters merged unless --keep-adapter), so the result loads
with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, with the run's loss log in
learning_curve.json. The final save is atomic. With --checkpoint-dir, Trainer checkpoints (weights, optimizer,
scheduler, RNG, data position) are kept there and a rerun resumes from the newest complete one.

Several processes (DDP, FSDP, DeepSpeed) come from accelerate, with the configs in configs/:

    accelerate launch --config_file configs/ddp.yaml scripts/train.py --model DIR --data train.jsonl --output OUT
    accelerate launch --config_file configs/fsdp.yaml scripts/train.py ... --checkpoint-dir runs/x --save-steps 200

Each process trains on its own shard of the data; --batch-size is per process (the global batch is batch size x
processes x --gradient-accumulation-steps). An example's noise is seeded by (--seed, its index, the epoch), and
the loss is the mean over the supervised tokens of the whole step, so N processes train like one process with the
same global batch. The main process writes one consolidated checkpoint (FSDP: a full state dict gathered first).
"""

from __future__ import annotations

import argparse

from clover.cli_clover import run_main
from clover.finetune_clover import fine_tune


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Clover checkpoint directory")
    parser.add_argument(
        "--tokenizer", default=None, help="directory of the tokenizer (default: --model; every checkpoint holds it)"
    )
    parser.add_argument("--data", required=True, help="JSONL of chat examples")
    parser.add_argument("--eval-data", default=None, help="JSONL for periodic eval (default: 5%% of --data)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-scheduler", default="linear", help="a transformers scheduler name, e.g. cosine")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=8, help="examples per batch on each process")
    parser.add_argument(
        "--gradient-accumulation-steps",
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="batches per optimizer step on each process",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=0,
        help="batches of similar length up to this many tokens (0: --batch-size)",
    )
    parser.add_argument("--max-length", type=int, default=None, help="default: the model's context")
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--logging-steps", type=int, default=None, help="default: eval-steps / 5")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--keep-adapter", action="store_true", help="save the LoRA adapter instead of merging")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--complementary", action="store_true", help="complementary masking")
    parser.add_argument("--noise-eps", type=float, default=1e-3, help="the smallest noise level t")
    parser.add_argument(
        "--suffix-noise",
        type=float,
        default=0.0,
        metavar="P",
        help="share of blocks masked as a suffix (a clean prefix, its last tokens masked) instead of uniformly",
    )
    parser.add_argument(
        "--decoding-state-noise",
        type=float,
        default=0.0,
        metavar="P",
        help="share of blocks trained in a state LowConfidence decoding meets (1-4 teacher-forced forwards of the "
        "model unmask what it would commit) instead of the collator's noise",
    )
    parser.add_argument(
        "--keep-wrong-masked",
        action="store_true",
        help="in those decoding states, a position the rule would commit with a wrong token stays masked (and "
        "scored) instead of being revealed",
    )
    parser.add_argument(
        "--causal-loss-weight", type=float, default=None, help="add a next-token loss on the clean sequence"
    )
    parser.add_argument(
        "--causal-distill-weight",
        type=float,
        default=None,
        help="pull each masked token's block-diffusion prediction towards the causal path's next-token "
        "distribution (KL divergence)",
    )
    parser.add_argument(
        "--layer-lr",
        type=layer_learning_rate,
        action="append",
        default=[],
        metavar="LAYER=LR",
        help="peak learning rate of one decoder layer instead of --lr (repeat per layer), e.g. for layers just "
        "added by scripts/add_layers.py: --layer-lr 4=1e-3 --layer-lr 5=1e-3",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, help="keep resumable Trainer checkpoints here")
    parser.add_argument("--save-steps", type=int, default=500, help="checkpoint interval with --checkpoint-dir")
    parser.add_argument(
        "--resume-from-checkpoint",
        "--resume",
        nargs="?",
        const="last",
        default=None,
        metavar="PATH",
        help="a checkpoint-N directory to resume from; alone (or 'last'): the newest complete one in "
        "--checkpoint-dir, which a rerun with --checkpoint-dir also resumes from by default",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the result to this Hub repo")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    if args.gradient_accumulation_steps < 1:
        parser.error(f"--gradient-accumulation-steps ({args.gradient_accumulation_steps}) must be 1 or more.")
    if args.resume_from_checkpoint == "last" and not args.checkpoint_dir:
        parser.error("--resume-from-checkpoint without a path resumes from --checkpoint-dir: pass that too.")
    if args.keep_wrong_masked and not args.decoding_state_noise:
        raise ValueError(
            "--keep-wrong-masked changes the decoding states of --decoding-state-noise P: pass P > 0 too."
        )
    return args


def layer_learning_rate(text: str) -> tuple[int, float]:
    """`--layer-lr` values: `LAYER=LR`, e.g. `4=1e-3`."""
    layer, sep, rate = text.partition("=")
    try:
        parsed = int(layer), float(rate)
    except ValueError:
        parsed = None
    if not sep or parsed is None or parsed[0] < 0 or parsed[1] < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not LAYER=LR (a layer index and a learning rate, e.g. 4=1e-3)")
    return parsed


def main(argv=None) -> None:
    fine_tune(parse_args(argv))


if __name__ == "__main__":
    run_main(main)
