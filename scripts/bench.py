"""Where block diffusion stands against autoregressive decoding, measured in one run on the same weights.

    python scripts/bench.py                                  # the shipped tiny model, CPU
    python scripts/bench.py --model DIR --output bench_results --prompts 8

1. Block-diffusion `generate` (batch 1, threshold 0.95) vs transformers' own `Qwen3_5MoeForCausalLM.generate`
   (greedy, KV cache) with the same weights, forced to the same number of new tokens: tok/s of each and the ratio.
2. Time per denoising step against prompt length (128 to 8192 tokens).
3. Loop overhead: generate's wall time over the time spent inside model forwards.
4. Forwards per committed block against denoising steps per block (equal when the commit is fused).
Prints a table, writes bench.json and bench.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover.cli_clover import checkpoint_dir, run_main
from clover.demo_tasks import FAMILIES, encode_example, generate_examples

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "clover-tiny-demo"
QWEN_FIELDS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim hidden_act "
    "max_position_embeddings rms_norm_eps attention_bias linear_conv_kernel_dim linear_key_head_dim "
    "linear_value_head_dim linear_num_key_heads linear_num_value_heads moe_intermediate_size "
    "shared_expert_intermediate_size num_experts_per_tok num_experts layer_types rope_parameters "
    "tie_word_embeddings pad_token_id eos_token_id"
).split()


def model_label(model: str) -> str:
    """The model as the results file names it: relative to the repository when it lies inside it."""
    path = Path(model).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else model


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=8, help="chat prompts (2 per task family)")
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=10, help="timed denoising steps per prompt length")
    parser.add_argument("--compile", action="store_true", help="also time generate(compile=True)")
    parser.add_argument("--output", default="bench_results")
    return parser.parse_args(argv)


def autoregressive_twin(model):
    """transformers' Qwen3_5MoeForCausalLM holding the same weights (Clover keeps its parameter names)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**{name: getattr(model.config, name) for name in QWEN_FIELDS})
    twin = Qwen3_5MoeForCausalLM(config).to(model.dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


class ForwardTimer:
    """Adds up the wall time spent inside a module's forward (for the loop-overhead ratio)."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self.calls = 0.0, 0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1


def bench_generation(model, twin, prompts, threshold, max_new_tokens) -> dict:
    timer = ForwardTimer(model.model)
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        model.generate(ids, max_new_tokens=8, threshold=threshold)  # warm-up (allocator, first-call paths)
        timer.seconds, timer.calls = 0.0, 0
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, threshold=threshold, return_dict_in_generate=True)
        diffusion_seconds = time.perf_counter() - start
        new_tokens = int(out.num_new_tokens[0])
        forwards = int(out.num_forward_passes[0])
        prefill_seconds = timer.seconds / max(timer.calls, 1)  # roughly; subtracted only from the overhead ratio

        twin.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        twin.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        ar_seconds = time.perf_counter() - start
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "new_tokens": new_tokens,
                "forwards": forwards,
                "blocks": len(out.steps_per_block),
                "steps_per_block": out.steps_per_block,
                "diffusion_seconds": diffusion_seconds,
                "ar_seconds": ar_seconds,
                "forward_seconds": timer.seconds,
                "forward_calls": timer.calls,
                "prefill_seconds_estimate": prefill_seconds,
            }
        )
    tokens = sum(r["new_tokens"] for r in rows)
    diffusion_tps = tokens / sum(r["diffusion_seconds"] for r in rows)
    ar_tps = tokens / sum(r["ar_seconds"] for r in rows)
    forwards_per_block = sum(r["forwards"] for r in rows) / sum(r["blocks"] for r in rows)
    steps_per_block = sum(sum(r["steps_per_block"]) for r in rows) / sum(r["blocks"] for r in rows)
    return {
        "rows": rows,
        "new_tokens": tokens,
        "diffusion_tok_per_s": diffusion_tps,
        "ar_tok_per_s": ar_tps,
        "speedup": diffusion_tps / ar_tps,
        "tokens_per_forward": tokens / sum(r["forwards"] for r in rows),
        "overhead": sum(r["diffusion_seconds"] for r in rows) / sum(r["forward_seconds"] for r in rows),
        "forwards_per_block": forwards_per_block,
        "denoising_steps_per_block": steps_per_block,
    }


def bench_compiled(model, prompts, threshold, max_new_tokens) -> dict:
    """generate(compile=True): the same decoding through torch.compile, compilation timed apart (a warm-up run per
    prompt traces every static-cache length the timed runs use)."""
    start = time.perf_counter()
    for prompt in prompts:
        model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, threshold=threshold, compile=True)
    compile_seconds = time.perf_counter() - start
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, threshold=threshold, compile=True, return_dict_in_generate=True
        )
        seconds += time.perf_counter() - start
        tokens += int(out.num_new_tokens[0])
    return {"compile_seconds": compile_seconds, "new_tokens": tokens, "tok_per_s": tokens / seconds}


@torch.no_grad()
def bench_step_time(model, prompt_lengths, steps) -> dict:
    """Median time of one denoising forward (a block of masks on the committed cache, as generate runs it for a
    prompt without padding) per prompt length."""
    from clover.modeling_clover import CloverCache

    config = model.config
    block = torch.full((1, config.block_size), config.mask_token_id)
    generator = torch.Generator().manual_seed(0)
    result = {}
    for length in prompt_lengths:
        prompt = torch.randint(0, config.mask_token_id, (1, length), generator=generator)
        cache = CloverCache(config)
        model.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        positions = torch.arange(length, length + config.block_size)[None]
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            hidden = model.model(
                input_ids=block, past_key_values=cache, block_ids=0, position_ids=positions, use_cache=False
            ).last_hidden_state
            model.lm_head(hidden)
            times.append(time.perf_counter() - start)
        result[length] = statistics.median(times[2:])  # the first calls warm caches up
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generation, steps = report["generation"], report["step_seconds"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = ["autoregressive\n(transformers)", "block diffusion\n(Clover, 0.95)"]
    values = [generation["ar_tok_per_s"], generation["diffusion_tok_per_s"]]
    if "compiled" in generation:
        labels.append("block diffusion\n+ torch.compile")
        values.append(generation["compiled"]["tok_per_s"])
    bars = left.bar(labels, values, color=["#999999", "#2b7a3d", "#1f5c99"][: len(values)])
    left.bar_label(bars, fmt="%.0f tok/s")
    left.set_ylabel("tokens / s (batch 1)")
    left.set_title(f"{generation['speedup']:.2f}x, {generation['tokens_per_forward']:.2f} tokens per forward")
    lengths = sorted(int(k) for k in steps)
    right.plot(lengths, [1000 * steps[str(n)] for n in lengths], marker="o")
    right.set_xscale("log", base=2)
    right.set_xlabel("prompt length (tokens)")
    right.set_ylabel("ms per denoising step")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    right.set_title("denoising step vs. prompt length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(args.model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    twin = autoregressive_twin(model)
    examples = generate_examples(args.prompts, seed=777, families=FAMILIES)
    prompts = [encode_example(tokenizer, e, model.config.max_position_embeddings)[0] for e in examples]

    generation = bench_generation(model, twin, prompts, args.threshold, args.max_new_tokens)
    step_seconds = bench_step_time(model, args.prompt_lengths, args.steps)
    if args.compile:
        compiled = bench_compiled(model, prompts, args.threshold, args.max_new_tokens)
        compiled["speedup_vs_ar"] = compiled["tok_per_s"] / generation["ar_tok_per_s"]
        generation["compiled"] = compiled
    shortest, longest = min(args.prompt_lengths), max(args.prompt_lengths)
    report = {
        "model": model_label(args.model),
        "threads": torch.get_num_threads(),
        "threshold": args.threshold,
        "generation": generation,
        "step_seconds": {str(k): v for k, v in step_seconds.items()},
        "step_ratio_longest_to_shortest": step_seconds[longest] / step_seconds[shortest],
    }
    g = generation
    print(f"new tokens: {g['new_tokens']} over {len(prompts)} prompts, batch 1, threshold {args.threshold}")
    print(f"{'':38} {'value':>10} {'target':>10}")
    print(f"{'autoregressive tok/s (transformers)':38} {g['ar_tok_per_s']:10.1f}")
    print(f"{'block diffusion tok/s (Clover)':38} {g['diffusion_tok_per_s']:10.1f}")
    print(f"{'speed-up':38} {g['speedup']:9.2f}x {'>= 3x':>10}")
    print(f"{'tokens per forward':38} {g['tokens_per_forward']:10.2f}")
    if "compiled" in g:
        c = g["compiled"]
        print(f"{'block diffusion, compile=True, tok/s':38} {c['tok_per_s']:10.1f}")
        print(f"{'speed-up, compile=True':38} {c['speedup_vs_ar']:9.2f}x {'>= 3x':>10}")
        print(f"{'(one-off compilation + warm-up, s)':38} {c['compile_seconds']:10.1f}")
    for length, seconds in step_seconds.items():
        print(f"{f'ms per denoising step, prompt {length}':38} {1000 * seconds:10.2f}")
    print(
        f"{f'step time ratio {longest} / {shortest}':38} {report['step_ratio_longest_to_shortest']:10.2f} {'<= 1.5':>10}"
    )
    print(f"{'loop overhead (wall / forwards)':38} {g['overhead']:10.3f} {'<= 1.15':>10}")
    print(f"{'forwards per block':38} {g['forwards_per_block']:10.2f}")
    print(f"{'denoising steps per block':38} {g['denoising_steps_per_block']:10.2f} {'== above':>10}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=1))
    plot(report, output / "bench.png")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")


if __name__ == "__main__":
    run_main(main)
