"""Makes the tiny demo models the way Clover was made: an autoregressive base, its conversion, the adaptation.

    python scripts/train_demo.py                      # every stage; rerun the same command to resume
    python scripts/train_demo.py --stages base        # one stage (the ones before it must be done)

The stages (data, base, convert, adapt), where a run keeps its work and how it resumes or extends: see
`clover.demo.recipe`.
"""

from __future__ import annotations

import argparse

from clover.cli_clover import run_main
from clover.demo.recipe import DEMO_ARCHITECTURE, REPO, STAGES, TRAINING_MIX, run_stages
from clover.demo.tasks import FAMILIES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(REPO / "models" / "clover-tiny-demo"), help="the Clover model")
    parser.add_argument(
        "--base-output", default=str(REPO / "models" / "qwen3_5_moe-tiny-demo"), help="the autoregressive base"
    )
    parser.add_argument("--work", default=str(REPO / "runs" / "tiny-demo"), help="checkpoints and intermediates")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--num-examples", type=int, default=200_000, help="training conversations")
    parser.add_argument(
        "--copy-warmup-examples",
        type=int,
        default=30_000,
        help="warm-up reversals the base starts on (a curriculum); with --wording train one seed had not learnt to "
        "copy after 30,000, another had after about 21,000: 80,000 leaves room (docs/demo_training.md)",
    )
    parser.add_argument(
        "--warmup-examples", type=int, default=45_000, help="warm-up conversations of every family, next"
    )
    parser.add_argument("--mix", type=float, nargs=len(FAMILIES), default=list(TRAINING_MIX), metavar="W")
    parser.add_argument(
        "--wording",
        choices=("templates", "train"),
        default="templates",
        help="how requests are worded, the tokenizer's text included: the original templates (the shipped models), "
        "or the wording bank's training part at every size a user asks about, with requests outside the families",
    )
    parser.add_argument(
        "--easy-direct-sums",
        type=int,
        default=0,
        metavar="N",
        help="N more training conversations: sums of two 2-digit numbers answered directly (thinking off)",
    )
    parser.add_argument(
        "--direct-sums",
        type=int,
        default=0,
        metavar="N",
        help="N more training conversations: sums of 2-3 digit numbers answered directly (thinking off)",
    )
    parser.add_argument(
        "--worked-additions",
        type=int,
        default=0,
        metavar="N",
        help="N more training conversations: additions of 3-6 digit numbers worked out column by column (thinking on)",
    )
    parser.add_argument(
        "--hard-examples",
        type=int,
        default=0,
        metavar="N",
        help="N more training conversations of the families in --mix, at the top of each family's size range "
        "(demo.tasks.LEVELS['hard']: the longest reversals and sorts, the widest additions)",
    )
    parser.add_argument(
        "--column-sum-width",
        type=int,
        choices=(1, 2),
        default=1,
        help="digits of a worked addition's column sums; 2 zero-pads them so every column line has one length",
    )
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary (every task word one token)")
    parser.add_argument("--hidden-size", type=int, default=DEMO_ARCHITECTURE["hidden_size"])
    parser.add_argument(
        "--layers", default="lflf", help="layer layout: l = Gated DeltaNet, f = full attention (e.g. lllflllf)"
    )
    parser.add_argument("--moe-intermediate-size", type=int, default=DEMO_ARCHITECTURE["moe_intermediate_size"])
    parser.add_argument(
        "--shared-expert-intermediate-size", type=int, default=DEMO_ARCHITECTURE["shared_expert_intermediate_size"]
    )
    parser.add_argument("--batch-tokens", type=int, default=4096, help="prompt + answer tokens per batch")
    parser.add_argument("--base-steps", type=int, default=7500)
    parser.add_argument("--base-lr", type=float, default=3e-3)
    parser.add_argument("--adapt-steps", type=int, default=6400)
    parser.add_argument("--adapt-lr", type=float, default=3e-3)
    parser.add_argument("--noise-eps", type=float, default=0.1, help="smallest noise level t of the adaptation")
    parser.add_argument(
        "--causal-loss-weight", type=float, default=1.0, help="next-token loss kept during the adaptation"
    )
    parser.add_argument("--save-steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--resume-from", default=None, metavar="CHECKPOINT", help="resume the first stage run from this checkpoint"
    )
    parser.add_argument("--force", action="store_true", help="replace outputs that this run did not write")
    return parser.parse_args(argv)


# ---- the run's record ------------------------------------------------------------------------------------------


# What makes each stage the same stage: a stage that has started (finished, or left checkpoints) is only continued
# under the settings that started it; a later stage may still change its own.
def main(argv=None) -> None:
    run_stages(parse_args(argv))


if __name__ == "__main__":
    run_main(main)
