"""Fine-tunes a Clover checkpoint on a JSONL of chat examples with the block-diffusion objective.

    python scripts/train.py --model models/clover-tiny-demo --data train.jsonl --output my-clover
    python scripts/train.py --model DIR --data train.jsonl --output my-clover --lora 16 --epochs 3
    python scripts/train.py ... --push-to-hub user/my-clover

Each line: {"messages": [... ending with the assistant reply], "tools": [...]?, "enable_thinking": true?} or
{"prompt": "...", "answer": "..."}. Uses transformers.Trainer (progress bar, periodic eval on --eval-data or a
held-out 5%), then saves with save_pretrained (LoRA adapters merged unless --keep-adapter), so the result loads
with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. The final save is atomic.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

from clover.training_clover import CloverDataCollator, encode_chat_example, read_chat_jsonl

LORA_MODULES = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]
LORA_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Clover checkpoint directory")
    parser.add_argument("--data", required=True, help="JSONL of chat examples")
    parser.add_argument("--eval-data", default=None, help="JSONL for periodic eval (default: 5%% of --data)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=None, help="default: the model's context")
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--keep-adapter", action="store_true", help="save the LoRA adapter instead of merging")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--complementary", action="store_true", help="complementary masking")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the result to this Hub repo")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


def load_examples(path: str, tokenizer, max_length: int) -> list[dict]:
    return [encode_chat_example(tokenizer, record, max_length) for record in read_chat_jsonl(path)]


def apply_lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=LORA_MODULES,
        target_parameters=LORA_EXPERT_PARAMETERS,  # the fused 3D experts are parameters, not nn.Linear
        lora_dropout=0.0,
    )
    return get_peft_model(model, config)


def main(argv=None) -> None:
    args = parse_args(argv)
    output = Path(args.output)
    if output.exists() and any(output.iterdir()) and not args.force:
        sys.exit(f"{output} exists and is not empty; pass --force to replace it.")
    set_seed(args.seed)  # before the LoRA init, which Trainer's own seeding comes too late for
    # trust_remote_code: the config is remote code, and without it AutoTokenizer asks on stdin before loading.
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True)
    max_length = args.max_length or model.config.max_position_embeddings
    try:
        train_set = load_examples(args.data, tokenizer, max_length)
        eval_set = load_examples(args.eval_data, tokenizer, max_length) if args.eval_data else None
    except ValueError as error:
        sys.exit(f"Bad training data: {error}")
    if eval_set is None and len(train_set) >= 20:
        random.Random(args.seed).shuffle(train_set)
        cut = max(1, len(train_set) // 20)
        eval_set, train_set = train_set[:cut], train_set[cut:]

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        model = apply_lora(model, args.lora)
        model.print_trainable_parameters()

    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".clover-train-", dir=output.parent))  # same filesystem: rename is atomic
    try:
        model = _train_and_save(args, model, tokenizer, train_set, eval_set, output, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints and a half-written model go, on failure too
    print(f"saved {output}")
    if args.push_to_hub:
        model.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        print(f"pushed to {args.push_to_hub}")


def _train_and_save(args, model, tokenizer, train_set, eval_set, output: Path, work: Path):
    """Trains in `work`, saves there, then swaps the result into `output`; returns the model as saved."""
    training_args = TrainingArguments(
        output_dir=str(work / "checkpoints"),
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        eval_strategy="steps" if eval_set else "no",
        eval_steps=args.eval_steps,
        logging_steps=max(1, args.eval_steps // 5),
        save_strategy="no",
        remove_unused_columns=False,  # the collator needs prompt_ids / answer_ids, not forward() arguments
        report_to=[],
        seed=args.seed,
        use_cpu=not __import__("torch").cuda.is_available(),
    )
    collator = CloverDataCollator(tokenizer.pad_token_id, model.config.block_size, args.seed, args.complementary)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set, data_collator=collator)  # fmt: skip
    trainer.train()

    if args.lora and not args.keep_adapter:
        model = model.merge_and_unload()
    final = work / "model"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    if output.exists():
        shutil.rmtree(output)
    final.rename(output)  # whole or nothing: the previous output survives any failure before this line
    return model


if __name__ == "__main__":
    main()
