"""The autoregressive base's batches and its fine-tuning (the first stage of the demo: next-token loss on the
answers)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..training_clover import unpack_batch


@dataclass
class CausalChatCollator:
    """Collates `{"prompt_ids", "answer_ids"}` features into a next-token training batch for an autoregressive model
    (the demo's Qwen3.5-MoE base): prompt + answer right-padded, labels on the answer only (the model shifts them).

    Right padding keeps every row's positions those it has alone (transformers' Qwen3.5-MoE counts positions from
    the first column), and padding after the answer is never seen by the answer's own tokens.
    """

    pad_token_id: int

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        features = unpack_batch(features)
        length = max(len(f["prompt_ids"]) + len(f["answer_ids"]) for f in features)
        input_ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        for row, feature in enumerate(features):
            prompt, answer = list(feature["prompt_ids"]), list(feature["answer_ids"])
            input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            attention_mask[row, : len(prompt) + len(answer)] = 1
            labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def causal_training_arguments(
    output_dir: str | Path,
    steps: int,
    lr: float,
    *,
    save_steps: int,
    seed: int,
    logging_steps: int = 25,
    evaluate: bool = True,
):
    """The base's Trainer settings (the recipe's base stage and `train_base`): cosine schedule, token-budget batches
    read in order, an eval and a checkpoint every `save_steps`, the last two checkpoints kept."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 50),
        weight_decay=0.01,
        adam_beta2=0.98,
        per_device_train_batch_size=1,  # each item is a token-budget batch
        per_device_eval_batch_size=1,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=save_steps,
        logging_steps=logging_steps,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=2,
        report_to=[],
        seed=seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=False,
        train_sampling_strategy="sequential",
    )


def train_base(
    model_dir: str | Path,
    data: str | Path,
    output: str | Path,
    *,
    eval_data: str | Path | None = None,
    max_steps: int,
    lr: float,
    batch_tokens: int = 4096,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    save_steps: int = 150,
    logging_steps: int = 25,
) -> None:
    """Fine-tunes an autoregressive checkpoint (the demo's Qwen3.5-MoE base) on a chat JSONL with next-token loss
    on the answers, by transformers.Trainer: how the base learns what a Clover made from it learns, so the two stay
    comparable. With `checkpoint_dir`, a rerun resumes from the newest Trainer checkpoint there. The output is
    written whole or not at all (with the run's loss log in learning_curve.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

    from ..chat_data_clover import encode_chat_examples, read_chat_jsonl
    from ..cli_clover import replace_directory
    from ..training_clover import token_budget_batches

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    max_length = model.config.max_position_embeddings

    def batches(path, batch_seed):
        return token_budget_batches(encode_chat_examples(tokenizer, read_chat_jsonl(path), max_length), batch_tokens, batch_seed)  # fmt: skip

    train = batches(data, seed)
    epoch = 1
    while len(train) < max_steps:  # reshuffled as often as the steps need
        train += batches(data, seed + epoch)
        epoch += 1
    checkpoints = Path(checkpoint_dir or Path(output).with_name(f".{Path(output).name}.checkpoints"))
    found = sorted(checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    arguments = causal_training_arguments(
        checkpoints, max_steps, lr, save_steps=save_steps, seed=seed, logging_steps=logging_steps,
        evaluate=eval_data is not None,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=train,
        eval_dataset=batches(eval_data, seed) if eval_data else None,
        data_collator=CausalChatCollator(tokenizer.pad_token_id),
    )
    if found:
        print(f"resuming from {found[-1]}")
    trainer.train(resume_from_checkpoint=str(found[-1]) if found else None)
    output = Path(output)
    staging = output.with_name(f".{output.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    (staging / "learning_curve.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    replace_directory(staging, output)


__all__ = ["CausalChatCollator", "causal_training_arguments", "train_base"]
