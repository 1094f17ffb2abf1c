"""TRL on Clover: plain `trl.SFTTrainer` trains the block-diffusion objective (never next-token loss),
`CloverSFTTrainer`'s defaults and refusals, and a LoRA fine-tune with it that teaches the shipped model a new task.
The shipped model and tokenizer; skipped without trl."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'clover[trl]')")
from datasets import Dataset  # noqa: E402  (trl brings datasets)
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402

from clover import CloverSFTTrainer  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "clover-tiny-demo"
# Words the demo tokenizer keeps whole with and without a leading space: the reply's first word has none, so a word
# split differently there ("apple" -> "ap" "ple", " apple" one token) must be spelled anew, not copied. With such
# words (apple river stone cloud tiger ...) the same recipe reached 8-9 of 16 on both decoding paths, the causal
# one included; with these, 16 of 16.
WORDS = "bread sun table umbrella zebra book horse clock cloud king money rabbit rain sister snow voice".split()
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO, trust_remote_code=True)


@pytest.fixture
def model():
    return AutoModelForCausalLM.from_pretrained(DEMO, trust_remote_code=True)


def repeat_twice(words: list[str], with_answer: bool = True) -> dict:
    """A chat of the new task: every word twice, in order."""
    messages = [{"role": "user", "content": "Repeat each word twice: " + " ".join(words)}]
    if with_answer:
        messages.append({"role": "assistant", "content": " ".join(w for w in words for _ in range(2))})
    return {"messages": messages, "chat_template_kwargs": NO_THINKING}


def chats(count: int, seed: int = 0, exclude=()) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        words = rng.sample(WORDS, 2)
        if tuple(words) not in exclude:
            rows.append(repeat_twice(words))
    return rows


def config(tmp_path, **overrides) -> trl.SFTConfig:
    options = dict(per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    return trl.SFTConfig(str(tmp_path), **(options | overrides))


def test_sft_trainer_loss_is_the_block_diffusion_objective_not_next_token_loss(model, tokenizer, tmp_path):
    trainer = trl.SFTTrainer(
        model, config(tmp_path), train_dataset=Dataset.from_list(chats(8)), processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # a causal-LM batch: no block_ids
    torch.manual_seed(0)
    trl_loss = trainer.compute_loss(trainer.model, dict(batch))
    torch.manual_seed(0)  # the same noise
    objective = model(**batch, output_router_logits=trainer.aux_loss_enabled).loss
    torch.testing.assert_close(trl_loss, objective)
    with torch.no_grad():  # what TRL's own fused head computes: next-token CE of the shifted labels
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        next_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    assert abs(float(trl_loss) - float(next_token)) > 0.5, (float(trl_loss), float(next_token))


def test_clover_sft_trainer_trains_chats_on_the_replies_with_lora_on_the_experts_and_checkpointing(
    model, tokenizer, tmp_path
):
    data = Dataset.from_list(chats(8))
    trainer = CloverSFTTrainer(model, config(tmp_path, gradient_checkpointing=True), train_dataset=data,
                               processing_class=tokenizer, peft_config=LoraConfig(r=4, lora_alpha=8))  # fmt: skip
    assert trainer.args.assistant_only_loss
    batch = next(iter(trainer.get_train_dataloader()))
    replies = {row["messages"][1]["content"] + "<|im_end|>" for row in data}
    for labels in batch["labels"]:  # the reply alone, through <|im_end|>
        assert tokenizer.decode(labels[labels != -100]) in replies
    trainable = {name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    assert any("experts" in name for name in trainable) and any("q_proj" in name for name in trainable)
    assert not any("mlp.gate." in name or "shared_expert_gate" in name for name in trainable)
    assert trainer.train().training_loss > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(packing=True), r"packing=True, padding_free=.*Set packing=False and padding_free=False"),
        (dict(label_smoothing_factor=0.1), r"label_smoothing_factor replace the loss"),
    ],
)
def test_clover_sft_trainer_refuses_what_the_objective_cannot_train(model, tokenizer, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        CloverSFTTrainer(model, config(tmp_path, **overrides), train_dataset=Dataset.from_list(chats(4)),
                         processing_class=tokenizer)  # fmt: skip


def test_a_packed_batch_is_refused_by_the_model_itself(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[-100, -100, 7, 8, -100, 10]])
    with pytest.raises(ValueError, match="A packed \\(padding-free\\) batch"):
        model(input_ids=ids, labels=labels, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))


@torch.no_grad()
def exact_replies(model, tokenizer, rows) -> tuple[int, float]:
    """(exact replies, mean tokens per forward) at threshold 0.95, greedy."""
    right, speed = 0, 0.0
    for row in rows:
        inputs = tokenizer.apply_chat_template(
            row["messages"][:1], add_generation_prompt=True, return_dict=True, return_tensors="pt", **NO_THINKING
        )
        out = model.generate(**inputs, max_new_tokens=32, threshold=0.95, return_dict_in_generate=True)
        reply = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += reply.strip() == row["messages"][1]["content"]
        speed += float(out.tokens_per_forward[0]) / len(rows)
    return right, speed


@pytest.mark.slow
def test_a_lora_fine_tune_teaches_the_shipped_model_a_new_task(model, tokenizer, tmp_path):
    """150 steps of LoRA (rank 8, the experts included) on "repeat each word twice": held-out word pairs go from
    none right to nearly all right, decoded at 0.95 (measured: 0/16 -> 16/16 at 5.0 tokens per forward, the causal
    path 16/16 too; 1,200 examples seen once). About 8 minutes on one thread."""
    held_out = chats(16, seed=1)
    train = chats(1200, seed=2, exclude={tuple(row["messages"][0]["content"].split()[-2:]) for row in held_out})
    before, _ = exact_replies(model.eval(), tokenizer, held_out)
    set_seed(0)
    args = config(
        tmp_path, max_steps=150, learning_rate=3e-3, per_device_train_batch_size=8, lr_scheduler_type="constant"
    )
    trainer = CloverSFTTrainer(model, args, train_dataset=Dataset.from_list(train), processing_class=tokenizer,
                               peft_config=LoraConfig(r=8, lora_alpha=16))  # fmt: skip
    trainer.train()
    after, tokens_per_forward = exact_replies(trainer.model.merge_and_unload().eval(), tokenizer, held_out)
    assert before == 0 and after >= 14, (before, after)
    assert tokens_per_forward > 3
