"""Trains the tiny demo Clover from scratch on the procedurally generated chat tasks (CPU, under an hour).

    python scripts/train_demo.py --output models/clover-tiny-demo

Builds the demo tokenizer, generates the corpus, trains with the block-diffusion objective (progress bar, loss
logged), and saves a checkpoint that loads with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`
plus `learning_curve.json` / `learning_curve.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from clover import CloverConfig, CloverForBlockDiffusion
from clover.demo_tasks import FAMILIES, build_demo_tokenizer, encode_example, generate_examples
from clover.training_clover import CloverDataCollator

DEMO_ARCHITECTURE = dict(
    hidden_size=192,
    num_hidden_layers=4,
    # Clover's layout: three Gated DeltaNet layers, then gated full attention. (A run with two attention layers out
    # of four learned no more copying from the prompt in the hour, and made a long prompt's step much dearer.)
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=48,
    linear_value_head_dim=48,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=160,
    shared_expert_intermediate_size=192,
    max_position_embeddings=1024,
    block_size=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)

# Tool-call prompts carry the tool list (about 350 tokens against 40 to 60 for the other families), so an example of
# that family costs several of the others; it gets fewer examples, addition (the hardest) the most.
TRAINING_MIX = [0.32, 0.28, 0.26, 0.14]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="models/clover-tiny-demo")
    parser.add_argument("--minutes", type=float, default=54.0, help="training time budget (the schedule fits it)")
    parser.add_argument("--num-examples", type=int, default=80000)
    parser.add_argument(
        "--mix",
        type=float,
        nargs=len(FAMILIES),
        default=TRAINING_MIX,
        metavar="W",
        help=f"relative number of training examples per family ({', '.join(FAMILIES)})",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=2048, help="BPE vocabulary (2048 makes every task word a single token)"
    )
    parser.add_argument("--batch-tokens", type=int, default=4096, help="prompt + answer tokens per batch (about)")
    parser.add_argument(
        "--noise-eps", type=float, default=0.1, help="smallest noise level t (a clipped schedule lowers the variance)"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--complementary", action="store_true", help="also train each example on its mask's complement"
    )
    parser.add_argument("--init", default=None, help="continue from this demo checkpoint instead of from scratch")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args()


def make_batches(encoded: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Groups examples of similar length so left padding wastes little; shuffles the groups."""
    order = sorted(encoded, key=lambda e: (len(e["prompt_ids"]), len(e["answer_ids"])))
    batches, current, longest = [], [], 0
    for example in order:
        length = len(example["prompt_ids"]) + len(example["answer_ids"])
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(example)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def save_curve(history: list[dict], output: Path) -> None:
    (output / "learning_curve.json").write_text(json.dumps(history, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["loss"] for h in history], lw=0.8, label="loss (EMA)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("block-diffusion loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title("Tiny Clover demo: training loss")
    fig.tight_layout()
    fig.savefig(output / "learning_curve.png", dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    output = Path(args.output)
    if output.exists() and not args.force:
        raise SystemExit(f"{output} exists; pass --force to replace it.")
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix=".clover-demo-", dir=output.parent if output.parent.exists() else None))

    if args.init:
        tokenizer = AutoTokenizer.from_pretrained(args.init)
        model = CloverForBlockDiffusion.from_pretrained(args.init)
        config = model.config
    else:
        tokenizer = build_demo_tokenizer(work, vocab_size=args.vocab_size, seed=args.seed)
        config = CloverConfig(
            vocab_size=len(tokenizer),
            mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **DEMO_ARCHITECTURE,
        )
        model = CloverForBlockDiffusion(config)
    model.generation_config.max_new_tokens = 256
    # As in Qwen's generation config: <|im_end|> ends a turn, and <|endoftext|> (the padding) ends it too.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {config.vocab_size}")

    # Training problems come from seed + 1 (+ 100 per continuation); eval_demo.py holds out seed 12345.
    seed = args.seed + 1 + (100 if args.init else 0)
    examples = generate_examples(args.num_examples, seed=seed, families=FAMILIES, weights=args.mix)
    encoded = []
    for example in tqdm(examples, desc="encoding", mininterval=2):
        prompt_ids, answer_ids = encode_example(tokenizer, example, config.max_position_embeddings - config.block_size)
        encoded.append({"prompt_ids": prompt_ids, "answer_ids": answer_ids})
    batches = make_batches(encoded, args.batch_tokens, rng)
    collator = CloverDataCollator(
        tokenizer.pad_token_id,
        config.block_size,
        seed=args.seed,
        eps=args.noise_eps,
        complementary=args.complementary,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    # Time-based schedule: warmup, then cosine to 10% over the budget, so the run ends on time on any machine.
    budget = args.minutes * 60
    warmup_seconds = 0.03 * budget

    def lr_at(elapsed: float) -> float:
        if elapsed < warmup_seconds:
            return args.lr * max(elapsed / warmup_seconds, 0.02)
        progress = min((elapsed - warmup_seconds) / (budget - warmup_seconds), 1.0)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    print(f"corpus: {len(encoded)} examples in {len(batches)} batches")
    model.train()
    history, ema, step, start = [], None, 0, time.time()
    if args.init and (Path(args.init) / "learning_curve.json").is_file():  # continue the curve of the first run
        history = json.loads((Path(args.init) / "learning_curve.json").read_text())
        step, ema = history[-1]["step"], history[-1]["loss"]
    bar = tqdm(total=int(budget), desc="training", unit="s", mininterval=5)
    while time.time() - start < budget:
        for batch_examples in batches:
            elapsed = time.time() - start
            if elapsed >= budget:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(elapsed)
            loss = model(**collator(batch_examples)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            if step % 10 == 0:
                history.append({"step": step, "seconds": round(elapsed, 1), "loss": ema, "lr": lr_at(elapsed)})
                bar.set_postfix(step=step, loss=f"{ema:.3f}")
                bar.update(int(elapsed) - bar.n)
            if step % 500 == 0:
                save_curve(history, work)
        rng.shuffle(batches)
    bar.close()

    model.eval()
    model.save_pretrained(work, safe_serialization=True)
    tokenizer.save_pretrained(work)
    save_curve(history, work)
    (work / "training_args.json").write_text(json.dumps({**vars(args), "steps": step}, indent=1))
    if output.exists():
        shutil.rmtree(output)
    work.rename(output)  # whole or nothing: a crash never leaves a half-written model behind
    print(f"saved {output} after {step} steps ({(time.time() - start) / 60:.1f} min), final loss {ema:.3f}")


if __name__ == "__main__":
    main()
