"""A fine-tuning run of a Clover checkpoint on chat JSONL, as `scripts/train.py` runs it (its docstring and flags
say what a run does): the data and its held-out share, transformers.Trainer with `CloverTrainer`, resumable
checkpoints, LoRA merged or kept, the atomic final save and the upload. `fine_tune(args)` takes the script's parsed
options; the parts are importable on their own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

from .chat_data_clover import encode_chat_examples, read_chat_jsonl
from .cli_clover import checkpoint_dir, replace_directory
from .trainer_clover import CloverTrainer, clover_lora_config
from .training_clover import CloverDataCollator, ExampleNoiseEpoch, number_examples, token_budget_batches


def fine_tune(args: argparse.Namespace) -> None:
    """Trains `--model` on `--data` and saves the result at `--output` (`args`: scripts/train.py's options)."""
    output = Path(args.output)
    if output.exists() and any(output.iterdir()) and not args.force:
        raise ValueError(f"{output} exists and is not empty; pass --force to replace it.")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)  # before the LoRA init, which Trainer's own seeding comes too late for
    tokenizer = load_tokenizer(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True)
    if args.causal_loss_weight is not None:
        model.config.causal_loss_weight = args.causal_loss_weight
    if args.causal_distill_weight is not None:
        model.config.causal_distill_weight = args.causal_distill_weight
    max_length = args.max_length or model.config.max_position_embeddings
    train_set, eval_set = training_and_eval_sets(args, tokenizer, max_length)
    resume = resume_point(args)
    if resume:
        check_checkpoint_matches(resume, model)

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        model = apply_lora(model, args.lora)
        model.print_trainable_parameters()

    training_args = training_arguments(args, has_eval=eval_set is not None)  # starts the process group, if any
    main_process = training_args.process_index == 0
    output.parent.mkdir(parents=True, exist_ok=True)
    work = shared_work_dir(output.parent, training_args)
    try:
        model = _train_and_save(args, training_args, model, tokenizer, train_set, eval_set, output, work, resume)
    finally:
        if main_process:
            shutil.rmtree(work, ignore_errors=True)  # a half-written model goes, on failure too
    if not main_process:
        return
    print(f"saved {output}")
    if args.push_to_hub:
        model.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        print(f"pushed to {args.push_to_hub}")


def training_and_eval_sets(args, tokenizer, max_length: int) -> tuple[list[dict], list[dict] | None]:
    """--data encoded, and --eval-data, else a held-out 5% of --data (from 20 examples on; none below), each
    example numbered (`number_examples`)."""
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
    # Each example's noise is keyed by its index here, the same on every process.
    train_set = number_examples(train_set)
    eval_set = number_examples(eval_set, start=len(train_set)) if eval_set else None
    return train_set, eval_set


def load_tokenizer(args):
    """The tokenizer of --tokenizer, else of --model; a directory without one gets an error naming the fix."""
    source = checkpoint_dir(args.model) if args.tokenizer is None else Path(args.tokenizer)
    if not (source / "tokenizer_config.json").is_file():
        flag = "--model" if args.tokenizer is None else "--tokenizer"
        raise ValueError(
            f"No tokenizer at {source} ({flag}; no tokenizer_config.json there): pass --tokenizer DIR, e.g. the "
            "--model of the run that wrote this checkpoint (a checkpoint of train.py holds its tokenizer)."
        )
    # trust_remote_code: the config is remote code, and without it AutoTokenizer asks on stdin before loading.
    return AutoTokenizer.from_pretrained(source, trust_remote_code=True)


def load_examples(path: str, tokenizer, max_length: int) -> list[dict]:
    return encode_chat_examples(tokenizer, read_chat_jsonl(path), max_length)


def apply_lora(model, rank: int):
    from peft import get_peft_model

    return get_peft_model(model, clover_lora_config(rank))


def resume_point(args) -> str | None:
    """The checkpoint to resume from: --resume-from-checkpoint PATH, else the newest complete one in
    --checkpoint-dir (a run killed while saving leaves a checkpoint without trainer_state.json, written last)."""
    if args.resume_from_checkpoint and args.resume_from_checkpoint != "last":
        path = Path(args.resume_from_checkpoint)
        if not (path / "trainer_state.json").is_file():
            raise ValueError(
                f"No Trainer checkpoint at {path} (no trainer_state.json there): pass a checkpoint-N directory."
            )
        return str(path)
    if args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():
        complete = [
            (int(match.group(1)), path)
            for path in Path(args.checkpoint_dir).iterdir()
            if (match := re.fullmatch(r"checkpoint-(\d+)", path.name)) and (path / "trainer_state.json").is_file()
        ]
        if complete:
            return str(max(complete)[1])
    if args.resume_from_checkpoint == "last":
        raise ValueError(
            f"--resume-from-checkpoint: no complete checkpoint in {args.checkpoint_dir}; "
            "drop the flag to start afresh."
        )
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


def training_arguments(args, has_eval: bool) -> TrainingArguments:
    """The Trainer settings; under `accelerate launch` (or torchrun) they pick up the process group."""
    batch_size = 1 if args.batch_tokens else args.batch_size  # --batch-tokens: each item is a whole batch
    checkpoints = args.checkpoint_dir is not None
    return TrainingArguments(
        output_dir=args.checkpoint_dir if checkpoints else None,  # without: set to the work dir before training
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        eval_strategy="steps" if has_eval else "no",
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


def shared_work_dir(parent: Path, training_args: TrainingArguments) -> Path:
    """A fresh directory next to the output (same filesystem: the final rename is atomic), made by the main process
    and named to every process."""
    name = [tempfile.mkdtemp(prefix=".clover-train-", dir=parent) if training_args.process_index == 0 else None]
    if training_args.world_size > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    return Path(name[0])


def _train_and_save(
    args, training_args, model, tokenizer, train_set, eval_set, output: Path, work: Path, resume: str | None
):
    """Trains (checkpoints in --checkpoint-dir, or none), saves in `work` from the main process, then swaps the
    result into `output`; returns the model as saved (on the main process)."""
    block_size = model.config.block_size
    if args.batch_tokens:  # each item is a whole batch of similar-length examples
        train_set = token_budget_batches(train_set, args.batch_tokens, args.seed, block_size)
        eval_set = token_budget_batches(eval_set, args.batch_tokens, args.seed, block_size) if eval_set else None
    if args.checkpoint_dir is None:
        training_args.output_dir = str(work / "checkpoints")
    collator = CloverDataCollator(
        tokenizer.pad_token_id,
        block_size,
        args.seed,
        args.complementary,
        eps=args.noise_eps,
        per_example_noise=True,
        suffix_prob=args.suffix_noise,
    )
    trainer: Trainer = CloverTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=tokenizer,  # saved into every checkpoint, so a checkpoint is a --model of its own
        callbacks=[ExampleNoiseEpoch(collator)],
        decoding_state_share=args.decoding_state_noise,
        decoding_state_keep_wrong=args.keep_wrong_masked,
        layer_learning_rates=dict(args.layer_lr),
    )
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and not trainer.is_fsdp_enabled:
        # accelerate enables FSDP only on accelerators; on CPU it trains plain data parallel instead.
        warnings.warn(
            "The accelerate config asks for FSDP, but accelerate runs FSDP on GPUs (or other accelerators) only: "
            f"training data parallel ({trainer.accelerator.distributed_type.value}) instead, every process "
            "holding the whole model. Use configs/ddp.yaml on CPU to say so.",
            stacklevel=1,
        )
    trainer.train(resume_from_checkpoint=resume)
    main_process = training_args.process_index == 0
    if main_process:
        print(describe_parallelism(trainer))

    final = work / "model"
    sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
    if args.lora and not args.keep_adapter and sharded:
        # Each process holds a shard: gather the adapter, then merge it into a fresh copy of the base.
        trainer.save_model(str(work / "adapter"))
        if main_process:
            from peft import PeftModel

            base = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True)
            model = PeftModel.from_pretrained(base, work / "adapter").merge_and_unload()
            model.save_pretrained(final)
    elif args.lora and not args.keep_adapter:
        model = model.merge_and_unload()
        if main_process:
            model.save_pretrained(final)
    else:
        trainer.save_model(str(final))  # FSDP: the full state dict, gathered; written by the main process only
        if main_process:
            (final / "training_args.bin").unlink(missing_ok=True)  # Trainer's pickle: not part of a checkpoint
            if sharded:  # the model here is a shard: the saved checkpoint is the whole one
                model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
    trainer.accelerator.wait_for_everyone()
    if not main_process:
        return model
    tokenizer.save_pretrained(final)
    (final / "learning_curve.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    replace_directory(final, output)  # whole or nothing: the previous output is moved aside, then deleted
    return model


def describe_parallelism(trainer) -> str:
    """How the run was spread: processes, engine, and for FSDP the units it sharded the model into."""
    processes = trainer.accelerator.num_processes
    engine = trainer.accelerator.distributed_type.value
    line = f"trained on {processes} process{'es' if processes > 1 else ''} ({engine})"
    if trainer.is_fsdp_enabled:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        units = Counter(
            type(module.module).__name__
            if isinstance(module, FullyShardedDataParallel)
            else type(module).__name__.removeprefix("FSDP")
            for module in trainer.model_wrapped.modules()
            if isinstance(module, (FSDPModule, FullyShardedDataParallel))
        )
        line += ", FSDP units: " + ", ".join(f"{name} x{count}" for name, count in units.items())
    return line


__all__ = [
    "apply_lora",
    "check_checkpoint_matches",
    "describe_parallelism",
    "fine_tune",
    "load_examples",
    "load_tokenizer",
    "resume_point",
    "shared_work_dir",
    "training_and_eval_sets",
    "training_arguments",
]
