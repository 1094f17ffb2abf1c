"""Convert a Hugging Face Qwen3.5-MoE checkpoint (text-only or multimodal) into a Clover checkpoint.

    python scripts/convert_qwen3_5_moe.py --input Qwen3.6-35B-A3B --output clover-35b-a3b-init

The output loads with `AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)`. See
`clover.conversion_clover` for what is converted, dropped and initialised.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from clover.cli_clover import run_main
from clover.conversion_clover import DEFAULT_MASK_TOKEN_ID, convert_qwen3_5_moe

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="Hugging Face Qwen3.5-MoE checkpoint directory")
    parser.add_argument("--output", required=True, type=Path, help="directory to write the Clover checkpoint into")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="dtype of the written weights")
    parser.add_argument(
        "--mask-token-id", type=int, default=DEFAULT_MASK_TOKEN_ID, help="id of <|mask|> (default %(default)s)"
    )
    parser.add_argument("--max-shard-size", default="2GB", help="largest output shard, e.g. 2GB or 500MB")
    parser.add_argument("--force", action="store_true", help="replace an existing, non-empty output directory")
    args = parser.parse_args(argv)

    report = convert_qwen3_5_moe(
        args.input,
        args.output,
        dtype=DTYPES[args.dtype],
        mask_token_id=args.mask_token_id,
        max_shard_size=args.max_shard_size,
        force=args.force,
    )
    print(report.summary())


if __name__ == "__main__":
    run_main(main)
