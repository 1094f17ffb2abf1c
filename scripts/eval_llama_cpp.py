"""Clover on llama.cpp against transformers, on held-out demo problems: the same tokens? the same exact match?

    python scripts/eval_llama_cpp.py                                # shipped model: f32, q8_0, q4_k_m; 100 problems
    python scripts/eval_llama_cpp.py --types f32 --problems 20 --threads 2

Each type is exported (scripts/export_gguf.py) to a temporary file; every problem is decoded alone, greedy, by
transformers' generate and by llama.cpp (llama_cpp_clover): block diffusion at the threshold, self-speculative, and
llama.cpp's own autoregressive decoding of the same file (whose output self-speculative decoding must equal). Prints
per type and strategy: token agreement with transformers, exact match of both, tokens per forward, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover.cli_clover import checkpoint_dir, run_main
from clover.demo.evaluation_llama_cpp import agreement, decode_llama_cpp, decode_transformers, prompt_ids, score
from clover.demo.tasks import generate_examples
from clover.gguf_clover import GGUF_TYPES, export_gguf
from clover.llama_cpp_clover import LlamaCppClover

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "clover-tiny-demo"
# llama.cpp strategy -> the transformers decoding it is compared with (AR: the causal greedy output, which
# self-speculative decoding reproduces exactly).
REFERENCE = {"low_confidence": "low_confidence", "self_speculative": "self_speculative", "autoregressive": "self_speculative"}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Clover checkpoint directory")
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0", "q4_k_m"], help=f"of {', '.join(GGUF_TYPES)}")
    parser.add_argument("--problems", type=int, default=100, help="held-out problems (families in turn)")
    parser.add_argument("--seed", type=int, default=12345, help="eval_demo.py's held-out seed")
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    for name in args.types:
        if name not in GGUF_TYPES:
            raise ValueError(f"--types: {name!r} is not one of {', '.join(GGUF_TYPES)}.")
    if args.problems < 1:
        raise ValueError(f"--problems ({args.problems}) must be at least 1.")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(args.model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    if model.config.model_type != "clover":
        raise ValueError(f"{args.model} is a {model.config.model_type} checkpoint; pass a Clover one.")
    examples = generate_examples(args.problems, seed=args.seed)
    prompts = prompt_ids(tokenizer, examples)
    reference = {
        s: decode_transformers(model, prompts, s, args.max_new_tokens, args.threshold) for s in set(REFERENCE.values())
    }
    results = {}
    header = f"{'type':>7} {'strategy':>17} | same tokens | exact (llama.cpp / transformers) | tok/fwd |  tok/s"
    print(header + "\n" + "-" * len(header))
    for strategy, ref in reference.items():
        s = score(tokenizer, examples, ref)
        print(f"{'torch':>7} {strategy:>17} |             | {'':>15}{100 * s['exact_match']:6.1f}%{'':>10} | "
              f"{s['tokens_per_forward']:7.2f} | {s['tokens_per_second']:6.0f}")  # fmt: skip
        results[f"transformers/{strategy}"] = s
    with tempfile.TemporaryDirectory() as folder:
        for gguf_type in args.types:
            path = export_gguf(args.model, Path(folder) / f"model.{gguf_type}.gguf", gguf_type, threads=args.threads)
            llama = LlamaCppClover(path, n_threads=args.threads)
            for strategy, ref_name in REFERENCE.items():
                decoded = decode_llama_cpp(llama, prompts, strategy, args.max_new_tokens, args.threshold)
                s = score(tokenizer, examples, decoded) | {"same_tokens": agreement(reference[ref_name], decoded)}
                exact_ref = results[f"transformers/{ref_name}"]["exact_match"]
                print(f"{gguf_type:>7} {strategy:>17} | {100 * s['same_tokens']:10.1f}% | {100 * s['exact_match']:14.1f}% / "
                      f"{100 * exact_ref:5.1f}%{'':>8} | {s['tokens_per_forward']:7.2f} | {s['tokens_per_second']:6.0f}")  # fmt: skip
                results[f"{gguf_type}/{strategy}"] = s
            llama.close()
            path.unlink()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
