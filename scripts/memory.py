"""How much GPU memory a Clover model needs: weights (per dtype and quantization) + cache, and which cards it fits.

    python scripts/memory.py                                  # Clover-35B-A3B, bf16, full 131,072-token context
    python scripts/memory.py --quantization nf4 --context 32768 --batch 4
    python scripts/memory.py --model DIR --dtype float16       # a checkpoint's config.json

Counted from the config alone (see `clover.memory_clover` for what is quantized and what stays 16-bit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from clover.cli_clover import checkpoint_dir, run_main
from clover.configuration_clover import CloverConfig
from clover.memory_clover import QUANTIZATIONS, estimate_memory, format_estimate

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a Clover checkpoint directory (reads its config.json)")
    source.add_argument("--config", default="35B", help="'35B' (CloverConfig defaults) or a config.json path")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's max)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--quantization", choices=list(QUANTIZATIONS), default="none")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    if args.model is not None:
        config = CloverConfig.from_pretrained(checkpoint_dir(args.model))
    elif args.config.upper() == "35B":
        config = CloverConfig()
    elif Path(args.config).is_file():
        config = CloverConfig.from_json_file(args.config)
    else:
        raise ValueError(f"--config {args.config!r} is neither '35B' nor a config.json file.")
    estimate = estimate_memory(config, args.context, args.batch, DTYPES[args.dtype], args.quantization)
    print(format_estimate(estimate))
    if args.json is not None:
        figures = {
            "dtype": args.dtype,
            "quantization": estimate.quantization,
            "context": estimate.context,
            "batch": estimate.batch_size,
            "parameters": estimate.parameters,
            "weight_bytes": estimate.weights,
            "cache_bytes": estimate.cache_total,
            "cache_attention_per_token": estimate.cache.attention_per_token,
            "cache_recurrent_per_sequence": estimate.cache.recurrent_per_sequence,
            "cache_conv_per_sequence": estimate.cache.conv_per_sequence,
            "total_bytes": estimate.total,
            "fits": estimate.fitting_gpus(),
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    run_main(main)
