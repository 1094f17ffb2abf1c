"""A Clover (or Qwen3.5-MoE) checkpoint as a GGUF file for llama.cpp (architecture qwen35moe).

    python scripts/export_gguf.py --output clover-tiny.gguf                       # the shipped demo model, f16
    python scripts/export_gguf.py --model DIR --output clover.q4_k_m.gguf --type q4_k_m

The file carries the weights in llama.cpp's layout, the tokenizer and chat template, and Clover's mask token,
block size and threshold; q8_0 and q4_k_m are made by llama.cpp's own quantizer. See docs/llama_cpp.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clover.cli_clover import run_main
from clover.gguf_clover import GGUF_TYPES, export_gguf

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "clover-tiny-demo"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="a Clover or Qwen3.5-MoE checkpoint directory"
    )
    parser.add_argument("--output", type=Path, required=True, help="the GGUF file to write")
    # Checked by export_gguf, so that a bad value gets the same one-line error as any other input.
    parser.add_argument("--type", default="f16", help=f"one of {', '.join(GGUF_TYPES)} (default f16)")
    parser.add_argument("--threads", type=int, default=0, help="threads of llama.cpp's quantizer (0: all cores)")
    args = parser.parse_args(argv)
    path = export_gguf(args.model, args.output, args.type, threads=args.threads)
    print(f"wrote {path} ({args.type}, {path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    run_main(main)
