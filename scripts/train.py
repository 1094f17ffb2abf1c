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
scheduler, RNG, data position, noise position) are kept there and a rerun resumes from the newest one.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from clover.cli_clover import checkpoint_dir, run_main
from clover.training_clover import (
    CloverDataCollator,
    encode_chat_examples,
    read_chat_jsonl,
    token_budget_batches,
)

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
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-scheduler", default="linear", help="a transformers scheduler name, e.g. cosine")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=8)
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
        "--causal-loss-weight", type=float, default=None, help="add a next-token loss on the clean sequence"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, help="keep resumable Trainer checkpoints here")
    parser.add_argument("--save-steps", type=int, default=500, help="checkpoint interval with --checkpoint-dir")
    parser.add_argument(
        "--resume-from-checkpoint",
        default=None,
        metavar="PATH",
        help="a checkpoint-N directory to resume from (default with --checkpoint-dir: its newest one)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the result to this Hub repo")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


def load_examples(path: str, tokenizer, max_length: int) -> list[dict]:
    return encode_chat_examples(tokenizer, read_chat_jsonl(path), max_length)


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


def resume_point(args) -> str | None:
    """The checkpoint to resume from: --resume-from-checkpoint, else the newest one in --checkpoint-dir."""
    if args.resume_from_checkpoint:
        path = Path(args.resume_from_checkpoint)
        if not (path / "trainer_state.json").is_file():
            raise ValueError(
                f"No Trainer checkpoint at {path} (no trainer_state.json there): pass a checkpoint-N directory."
            )
        return str(path)
    if args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():
        return get_last_checkpoint(args.checkpoint_dir)
    return None


def check_checkpoint_matches(checkpoint: str, model) -> None:
    """A checkpoint of another model would load its optimizer state into the wrong shapes, or silently train on."""
    saved = Path(checkpoint) / "config.json"
    if not saved.is_file():  # a LoRA checkpoint saves the adapter only; its adapter_config names the base
        return
    config = json.loads(saved.read_text())
    ours = model.config.to_dict()
    differs = [
        k for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size") if config.get(k) != ours.get(k)
    ]
    if differs:
        raise ValueError(
            f"{checkpoint} is a checkpoint of another model ({', '.join(f'{k}={config.get(k)!r}' for k in differs)} "
            f"where --model has {', '.join(f'{k}={ours.get(k)!r}' for k in differs)}): resume with the model it was "
            "trained from, or point --checkpoint-dir elsewhere."
        )


class NoisePosition(TrainerCallback):
    """Puts the collator's noise stream where a resumed run left it, so a resumed run draws the same masks."""

    def __init__(self, collator: CloverDataCollator):
        self.collator = collator

    def on_train_begin(self, args, state, control, **kwargs):
        self.collator.calls = state.global_step * args.gradient_accumulation_steps


def main(argv=None) -> None:
    args = parse_args(argv)
    output = Path(args.output)
    if output.exists() and any(output.iterdir()) and not args.force:
        raise ValueError(f"{output} exists and is not empty; pass --force to replace it.")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)  # before the LoRA init, which Trainer's own seeding comes too late for
    # trust_remote_code: the config is remote code, and without it AutoTokenizer asks on stdin before loading.
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(args.model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True)
    if args.causal_loss_weight is not None:
        model.config.causal_loss_weight = args.causal_loss_weight
    max_length = args.max_length or model.config.max_position_embeddings
    try:
        train_set = load_examples(args.data, tokenizer, max_length)
        eval_set = load_examples(args.eval_data, tokenizer, max_length) if args.eval_data else None
    except ValueError as error:
        raise ValueError(f"Bad training data: {error}") from None
    except FileNotFoundError as error:
        raise ValueError(f"No such data file: {error.filename}") from None
    if eval_set is None and len(train_set) >= 20:
        random.Random(args.seed).shuffle(train_set)
        cut = max(1, len(train_set) // 20)
        eval_set, train_set = train_set[:cut], train_set[cut:]
    resume = resume_point(args)
    if resume:
        check_checkpoint_matches(resume, model)

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        model = apply_lora(model, args.lora)
        model.print_trainable_parameters()

    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".clover-train-", dir=output.parent))  # same filesystem: rename is atomic
    try:
        model = _train_and_save(args, model, tokenizer, train_set, eval_set, output, work, resume)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a half-written model goes, on failure too
    print(f"saved {output}")
    if args.push_to_hub:
        model.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        print(f"pushed to {args.push_to_hub}")


def _train_and_save(args, model, tokenizer, train_set, eval_set, output: Path, work: Path, resume: str | None):
    """Trains (checkpoints in --checkpoint-dir, or none), saves in `work`, then swaps the result into `output`;
    returns the model as saved."""
    block_size = model.config.block_size
    batch_size = args.batch_size
    if args.batch_tokens:  # each item is a whole batch of similar-length examples
        train_set = token_budget_batches(train_set, args.batch_tokens, args.seed, block_size)
        eval_set = token_budget_batches(eval_set, args.batch_tokens, args.seed, block_size) if eval_set else None
        batch_size = 1
    checkpoints = args.checkpoint_dir is not None
    training_args = TrainingArguments(
        output_dir=args.checkpoint_dir if checkpoints else str(work / "checkpoints"),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        eval_strategy="steps" if eval_set else "no",
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps or max(1, args.eval_steps // 5),
        save_strategy="steps" if checkpoints else "no",
        save_steps=args.save_steps,
        save_total_limit=2,
        remove_unused_columns=False,  # the collator needs prompt_ids / answer_ids, not forward() arguments
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    collator = CloverDataCollator(
        tokenizer.pad_token_id, block_size, args.seed, args.complementary, eps=args.noise_eps
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        callbacks=[NoisePosition(collator)],
    )
    trainer.train(resume_from_checkpoint=resume)

    if args.lora and not args.keep_adapter:
        model = model.merge_and_unload()
    final = work / "model"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "learning_curve.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    if output.exists():
        shutil.rmtree(output)
    final.rename(output)  # whole or nothing: the previous output survives any failure before this line
    return model


if __name__ == "__main__":
    run_main(main)
