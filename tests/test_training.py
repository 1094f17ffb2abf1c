"""Fine-tuning: CloverDataCollator's batch layout and noise, the block-diffusion loss against a per-block
reference, transformers.Trainer on a tiny Clover, and scripts/train.py end to end on the demo checkpoint (LoRA on
the attention, GDN and fused 3D experts; merge, adapter, push_to_hub to a local stand-in Hub, bad data)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import CODE_FILES
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from clover.chat_data_clover import encode_chat_example
from clover.finetune_clover import apply_lora
from clover.modeling_clover import CloverForBlockDiffusion, batch_from_labels, examples_from_labels
from clover.trainer_clover import LORA_MODULES, CloverTrainer, decoding_state_noise
from clover.training_clover import CloverDataCollator

REPO = Path(__file__).resolve().parents[1]
DEMO = Path(os.environ.get("CLOVER_DEMO_MODEL", REPO / "models" / "clover-tiny-demo"))
WORDS = (
    "apple river stone cloud tiger lemon piano castle garden rocket silver forest candle mirror planet window".split()
)


# --------------------------------------------------------------------------------------------------------------------
# CloverDataCollator
# --------------------------------------------------------------------------------------------------------------------

PAD, EOS, MASK = 0, 126, 127


def _features(lengths: list[tuple[int, int]]) -> list[dict]:
    """(prompt_len, answer_len) -> features with distinct ids; each answer ends with EOS."""
    out = []
    for row, (prompt_len, answer_len) in enumerate(lengths):
        prompt = [1 + (row * 7 + i) % 60 for i in range(prompt_len)]
        answer = [61 + (row * 5 + i) % 60 for i in range(answer_len - 1)] + [EOS]
        out.append({"prompt_ids": prompt, "answer_ids": answer})
    return out


def test_collator_lines_answers_up_and_supervises_through_the_last_block():
    features = [
        {"prompt_ids": [5, 6, 7], "answer_ids": [10, 11, 12, 13, 14, EOS]},  # 6 answer tokens: 2 blocks of 4
        {"prompt_ids": [8], "answer_ids": [20, EOS]},  # 2 answer tokens: 1 block, then an unsupervised block
    ]
    batch = CloverDataCollator(pad_token_id=PAD, block_size=4)(features)
    _ = -100
    # prompts left-padded to 3 columns; answers from column 3, right-padded to the widest answer's 2 blocks
    torch.testing.assert_close(batch["input_ids"], torch.tensor([
        [5, 6, 7, 10, 11, 12, 13, 14, EOS, PAD, PAD],
        [PAD, PAD, 8, 20, EOS, PAD, PAD, PAD, PAD, PAD, PAD],
    ]))  # fmt: skip
    torch.testing.assert_close(batch["attention_mask"], torch.tensor([[1] * 11, [0, 0] + [1] * 9]))
    torch.testing.assert_close(batch["block_ids"], torch.tensor([[-1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1]] * 2))
    # pad after EOS is supervised up to the end of the row's last block, nothing after it
    torch.testing.assert_close(batch["labels"], torch.tensor([
        [_, _, _, 10, 11, 12, 13, 14, EOS, PAD, PAD],
        [_, _, _, 20, EOS, PAD, PAD, _, _, _, _],
    ]))  # fmt: skip


def test_collator_noise_is_reproducible_per_seed_and_differs_across_seeds():
    features = _features([(3, 20), (5, 9), (2, 30), (4, 17)])
    first = CloverDataCollator(PAD, 8, seed=7)(features)
    again = CloverDataCollator(PAD, 8, seed=7)(features)
    other = CloverDataCollator(PAD, 8, seed=8)(features)
    torch.testing.assert_close(first["noise_mask"], again["noise_mask"])
    torch.testing.assert_close(first["noise_level"], again["noise_level"])
    assert not torch.equal(first["noise_level"], other["noise_level"])
    assert not torch.equal(first["noise_mask"], other["noise_mask"])


def test_collator_draws_fresh_noise_on_every_call():
    # One collator serves a whole run: each epoch must see new masks, not the first batch's again.
    collator = CloverDataCollator(PAD, 8, seed=0)
    features = _features([(3, 20), (5, 9)])
    assert not torch.equal(collator(features)["noise_mask"], collator(features)["noise_mask"])


def test_collator_masks_only_supervised_tokens_with_one_level_per_block():
    features = _features([(3, 20), (5, 9), (2, 30), (4, 17)])
    batch = CloverDataCollator(PAD, 8, seed=3, eps=1e-3)(features)
    supervised = batch["labels"] != -100
    assert batch["noise_mask"].any()
    assert not (batch["noise_mask"] & ~supervised).any()
    level, block_ids = batch["noise_level"], batch["block_ids"]
    assert bool((level[block_ids < 0] == 1).all())  # outside the answer blocks the level is a neutral 1
    for row in range(len(features)):
        for block in range(int(block_ids.max()) + 1):
            levels = level[row][block_ids[row] == block]
            assert bool((levels == levels[0]).all()), (row, block)  # t is drawn per (row, block)
            assert 1e-3 <= float(levels[0]) < 1


def test_collator_complementary_doubles_the_batch_with_the_complement_mask():
    features = _features([(3, 20), (5, 9), (2, 30)])
    plain = CloverDataCollator(PAD, 8, seed=5)(features)
    pair = CloverDataCollator(PAD, 8, seed=5, complementary=True)(features)
    n = len(features)
    for key in ("input_ids", "attention_mask", "labels", "block_ids"):
        torch.testing.assert_close(pair[key], torch.cat([plain[key], plain[key]]))
    torch.testing.assert_close(pair["noise_mask"][:n], plain["noise_mask"])
    supervised = plain["labels"] != -100
    first, second = pair["noise_mask"][:n], pair["noise_mask"][n:]
    assert not (first & second).any()
    torch.testing.assert_close(first | second, supervised)  # every supervised token masked exactly once per pair
    in_block = plain["block_ids"] >= 0
    torch.testing.assert_close(pair["noise_level"][n:][in_block], 1 - plain["noise_level"][in_block])
    torch.testing.assert_close(pair["noise_level"][n:][~in_block], plain["noise_level"][~in_block])


@pytest.mark.parametrize("per_example_noise", [False, True])
def test_collator_suffix_noise_masks_the_last_ceil_t_n_supervised_tokens_of_each_block(per_example_noise):
    features = [dict(f, example_index=i) for i, f in enumerate(_features([(3, 20), (5, 9), (2, 30), (4, 17)]))]
    batch = CloverDataCollator(PAD, 8, seed=4, suffix_prob=1.0, per_example_noise=per_example_noise)(features)
    supervised, block_ids = batch["labels"] != -100, batch["block_ids"]
    for row in range(len(features)):
        for block in range(int(block_ids.max()) + 1):
            positions = ((block_ids[row] == block) & supervised[row]).nonzero().flatten().tolist()
            if not positions:
                continue
            t = float(batch["noise_level"][row, positions[0]])
            expected = positions[len(positions) - math.ceil(t * len(positions)) :]
            assert batch["noise_mask"][row][block_ids[row] == block].nonzero().flatten().tolist() == [
                p - int((block_ids[row] < block).sum()) for p in expected
            ], (row, block, t)


def test_collator_without_suffix_noise_draws_the_uniform_masks_unchanged():
    features = _features([(3, 20), (5, 9), (2, 30)])
    plain = CloverDataCollator(PAD, 8, seed=9)(features)
    zero = CloverDataCollator(PAD, 8, seed=9, suffix_prob=0.0)(features)
    half = CloverDataCollator(PAD, 8, seed=9, suffix_prob=0.5)(features)
    torch.testing.assert_close(zero["noise_mask"], plain["noise_mask"])
    torch.testing.assert_close(half["noise_level"], plain["noise_level"])  # the same t, some blocks masked as suffix
    with pytest.raises(ValueError, match=r"suffix_prob \(1.5\).*\[0, 1\]"):
        CloverDataCollator(PAD, 8, suffix_prob=1.5)


@pytest.mark.parametrize("empty", ["prompt_ids", "answer_ids"])
def test_collator_rejects_an_empty_prompt_or_answer_naming_the_example(empty):
    features = _features([(3, 5), (4, 6), (2, 3)])
    features[2][empty] = []
    with pytest.raises(ValueError, match=r"Example 2 has an empty " + empty.split("_")[0]):
        CloverDataCollator(PAD, 8)(features)


# --------------------------------------------------------------------------------------------------------------------
# The loss and transformers.Trainer on a tiny Clover
# --------------------------------------------------------------------------------------------------------------------


def test_diffusion_loss_matches_a_per_block_reference(tiny_model):
    # The objective: block k is noised and sees the prompt and the *clean* blocks < k. The reference runs one plain
    # block-causal forward per (row, block) on [prompt, clean blocks < k, noisy block k], unpadded, and weights
    # the CE of the masked tokens by label_weight / t over the weighted number of supervised tokens.
    features = _features([(3, 19), (5, 7)])
    batch = CloverDataCollator(PAD, 8, seed=1)(features)
    loss = tiny_model(**batch).loss
    answer_start = int((batch["block_ids"][0] >= 0).nonzero()[0])
    total = torch.zeros(())
    for row, feature in enumerate(features):
        prompt = torch.tensor(feature["prompt_ids"])
        answer = batch["input_ids"][row, answer_start:]
        masked = batch["noise_mask"][row, answer_start:]
        level = batch["noise_level"][row, answer_start:]
        weight = batch["label_weights"][row, answer_start:]
        for block in range(answer.shape[0] // 8):
            cols = slice(8 * block, 8 * block + 8)
            if not masked[cols].any():
                continue
            noisy = torch.where(masked[cols], MASK, answer[cols])
            input_ids = torch.cat([prompt, answer[: 8 * block], noisy])[None]
            block_ids = torch.cat([torch.full((len(prompt),), -1), torch.arange(8 * (block + 1)) // 8])[None]
            logits = tiny_model(input_ids=input_ids, block_ids=block_ids, use_cache=False).logits[0, -8:]
            token_loss = F.cross_entropy(logits[masked[cols]], answer[cols][masked[cols]], reduction="none")
            total = total + (token_loss * weight[cols][masked[cols]] / level[cols][masked[cols]]).sum()
    expected = total / batch["label_weights"].sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def _causal_lm_batch(features: list[dict]) -> dict:
    """The features as a Trainer-based client (TRL) passes them: prompt + answer right-padded, labels aligned with
    input_ids, -100 on the prompt and the padding."""
    length = max(len(f["prompt_ids"]) + len(f["answer_ids"]) for f in features)
    input_ids = torch.full((len(features), length), PAD)
    attention_mask, labels = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
    for row, feature in enumerate(features):
        prompt, answer = feature["prompt_ids"], feature["answer_ids"]
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention_mask[row, : len(prompt) + len(answer)] = 1
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.fixture
def loss_model(tiny_config):
    """A tiny Clover whose objective includes the causal next-token term."""
    torch.manual_seed(0)
    return CloverForBlockDiffusion(tiny_config(causal_loss_weight=0.5)).float().eval()


def test_labels_alone_give_the_collators_batch_and_its_loss(loss_model):
    features = _features([(3, 19), (5, 7), (2, 9)])
    causal = _causal_lm_batch(features)
    collated = CloverDataCollator(PAD, 8, seed=1)(features)
    torch.manual_seed(3)
    rebuilt = batch_from_labels(**causal, config=loss_model.config)
    for key in ("input_ids", "attention_mask", "labels", "label_weights", "block_ids"):
        assert torch.equal(rebuilt[key], collated[key]), key
    # The same noise: the collator's batch, the rebuilt batch and the labels alone (same torch seed) agree.
    collated |= {"noise_mask": rebuilt["noise_mask"], "noise_level": rebuilt["noise_level"]}
    expected = loss_model(**collated).loss
    torch.testing.assert_close(loss_model(**rebuilt).loss, expected, rtol=0, atol=0)
    torch.manual_seed(3)
    torch.testing.assert_close(loss_model(**causal).loss, expected, rtol=1e-6, atol=1e-6)
    torch.manual_seed(4)
    assert not torch.allclose(loss_model(**causal).loss, expected)  # the noise comes from torch's generator


@pytest.mark.parametrize("causal_loss_weight", [0.0, 0.5])
def test_causal_distillation_adds_the_kl_from_the_causal_path_to_each_masked_prediction(
    tiny_config, causal_loss_weight
):
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(tiny_config(causal_loss_weight=causal_loss_weight)).float().eval()
    batch = CloverDataCollator(PAD, 8, seed=1)(_features([(3, 19), (5, 7), (2, 9)]))
    plain = model(**batch)
    model.config.causal_distill_weight = 0.3
    distilled = model(**batch)
    # Reference: the causal path's next-token distribution from a plain causal forward (no labels), against the
    # block-diffusion logits the loss scored (returned in the order of the scored tokens).
    supervised = batch["labels"] != -100
    scored = batch["noise_mask"] & supervised
    with torch.no_grad():
        causal_logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    teacher = causal_logits[:, :-1][scored[:, 1:]].log_softmax(-1)
    student = plain.logits.log_softmax(-1)
    divergence = (teacher.exp() * (teacher - student)).sum(-1)
    weights = batch["label_weights"][scored] / batch["noise_level"][scored]
    expected = 0.3 * (divergence * weights).sum() / batch["label_weights"].sum()
    assert float(expected) > 1e-3
    torch.testing.assert_close(distilled.loss - plain.loss, expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"causal_distill_weight \(-1\) must be a number >= 0"):
        tiny_config(causal_distill_weight=-1)


def test_labels_with_several_answers_in_a_row_train_each_after_the_conversation_before_it():
    # [p p a a u u b b b pad]: two supervised runs -> (p p, a a) and (p p a a u u, b b b); a run from the first
    # token leaves that token to the prompt.
    input_ids = torch.tensor([[1, 2, 10, 11, 3, 4, 20, 21, 22, 0], [30, 31, 32, 0, 0, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    labels = torch.where(input_ids >= 10, input_ids, -100).masked_fill(attention_mask == 0, -100)
    assert examples_from_labels(input_ids, attention_mask, labels) == [
        ([1, 2], [10, 11]),
        ([1, 2, 10, 11, 3, 4], [20, 21, 22]),
        ([30], [31, 32]),
    ]
    with pytest.raises(ValueError, match="labels supervise no token"):
        examples_from_labels(input_ids, attention_mask, torch.full_like(labels, -100))


def test_fused_lm_head_terms_sum_to_the_loss(loss_model):
    batch = CloverDataCollator(PAD, 8, seed=1)(_features([(3, 19), (5, 7)]))
    output = loss_model(**batch, fused_lm_head=True)
    torch.testing.assert_close(-output.log_probs.sum() / output.label_mask.sum(), output.loss)
    torch.testing.assert_close(output.label_mask, batch["label_weights"])
    assert float(output.entropy.sum()) > 0 and float(output.is_top1.sum()) >= 0
    with pytest.raises(ValueError, match="fused_lm_head=True returns the training objective's terms: pass labels"):
        loss_model(batch["input_ids"], fused_lm_head=True)


@pytest.mark.parametrize("sure", [False, True])
def test_decoding_state_noise_unmasks_what_one_lowconfidence_forward_commits(tiny_model, sure):
    # Reference: one plain block-causal forward per (row, block) on [prompt, clean blocks < k, all-masked block k];
    # the rule commits every masked position at probability >= 0.95 and at least the most confident one.
    if sure:  # a sharper head, so that the threshold, not just the most confident position, decides
        tiny_model.lm_head.weight.data *= 60
    features = _features([(3, 19), (5, 7)])
    batch = CloverDataCollator(PAD, 8, seed=1)(features)
    state = decoding_state_noise(
        tiny_model, batch, share=1.0, generator=torch.Generator().manual_seed(0), max_forwards=1
    )
    start = int((batch["block_ids"][0] >= 0).nonzero()[0])
    supervised = (batch["labels"] != -100)[:, start:]
    above_threshold = 0
    for row, feature in enumerate(features):
        prompt = torch.tensor(feature["prompt_ids"])
        answer = batch["input_ids"][row, start:]
        for block in range(answer.shape[0] // 8):
            cols = slice(8 * block, 8 * block + 8)
            masked = state["noise_mask"][row, start:][cols]
            if not supervised[row, cols].any():
                assert not masked.any()
                continue
            input_ids = torch.cat([prompt, answer[: 8 * block], torch.full((8,), MASK)])[None]
            block_ids = torch.cat([torch.full((len(prompt),), -1), torch.arange(8 * (block + 1)) // 8])[None]
            logits = tiny_model(input_ids=input_ids, block_ids=block_ids, use_cache=False).logits[0, -8:]
            logits[:, MASK] = -math.inf
            confidence = logits.softmax(-1).amax(-1).masked_fill(~supervised[row, cols], -1.0)
            commit = (confidence >= 0.95) | (torch.arange(8) == confidence.argmax())
            above_threshold += int((confidence >= 0.95).sum())
            assert torch.equal(masked, supervised[row, cols] & ~commit), (row, block)
            level = state["noise_level"][row, start:][cols]
            share = max(masked.sum() / supervised[row, cols].sum(), 0.1)
            torch.testing.assert_close(level, torch.full((8,), float(share)))
    assert (above_threshold > 1) == sure
    assert torch.equal(state["input_ids"], batch["input_ids"]) and state["noise_mask"] is not batch["noise_mask"]


def test_decoding_state_noise_keeps_what_the_rule_would_commit_wrongly_masked(tiny_model):
    # One block of 8 answer tokens, all masked: the rule commits several positions (a sharpened head); the answer is
    # rewritten so that the model's candidate is right at half of them. With keep_wrong_masked only those are
    # revealed; the ones the rule would commit with a wrong token stay masked, for the loss to score.
    tiny_model.lm_head.weight.data *= 60
    features = _features([(3, 8)])
    prompt = torch.tensor(features[0]["prompt_ids"])
    input_ids = torch.cat([prompt, torch.full((8,), MASK)])[None]
    block_ids = torch.cat([torch.full((3,), -1), torch.zeros(8, dtype=torch.long)])[None]
    logits = tiny_model(input_ids=input_ids, block_ids=block_ids, use_cache=False).logits[0, -8:]
    logits[:, MASK] = -math.inf
    confidence, candidate = logits.softmax(-1).max(-1)
    commit = (confidence >= 0.95) | (torch.arange(8) == confidence.argmax())
    committed = commit.nonzero().flatten().tolist()
    assert len(committed) >= 2
    right = torch.zeros(8, dtype=torch.bool)
    right[committed[::2]] = True
    answer = torch.tensor(features[0]["answer_ids"])
    answer = torch.where(right, candidate, torch.where(candidate == answer, (answer + 1) % MASK, answer))
    features[0]["answer_ids"] = answer.tolist()
    batch = CloverDataCollator(PAD, 8, seed=1)(features)
    generator = torch.Generator().manual_seed(0)
    state = decoding_state_noise(tiny_model, batch, 1.0, generator, max_forwards=1, keep_wrong_masked=True)
    assert torch.equal(state["noise_mask"][0, 3:11], ~right)
    plain = decoding_state_noise(tiny_model, batch, 1.0, torch.Generator().manual_seed(0), max_forwards=1)
    assert torch.equal(plain["noise_mask"][0, 3:11], ~commit)


def test_decoding_state_noise_unmasks_one_position_per_forward_when_nothing_is_sure(tiny_model):
    # A random tiny model is never sure (p < 0.95 everywhere): each forward commits exactly one position, so a
    # block drawn to run f forwards ends with min(f, its supervised tokens) of them unmasked.
    features = _features([(4, 30), (6, 12)])
    batch = CloverDataCollator(PAD, 8, seed=2)(features)
    state = decoding_state_noise(tiny_model, batch, share=1.0, generator=torch.Generator().manual_seed(5))
    forwards = torch.randint(1, 5, (2, batch["input_ids"].shape[1] // 8), generator=torch.Generator().manual_seed(5))
    start = int((batch["block_ids"][0] >= 0).nonzero()[0])
    supervised = (batch["labels"] != -100)[:, start:].reshape(2, -1, 8)
    masked = state["noise_mask"][:, start:].reshape(2, -1, 8)
    assert not (masked & ~supervised).any()
    unmasked = (supervised & ~masked).sum(-1)
    assert torch.equal(unmasked, torch.minimum(forwards[:, : unmasked.shape[1]], supervised.sum(-1)))


def test_decoding_state_noise_share_zero_is_the_batch_and_a_bad_share_is_named(tiny_model):
    batch = CloverDataCollator(PAD, 8, seed=1)(_features([(3, 9)]))
    assert decoding_state_noise(tiny_model, batch, share=0.0) is batch
    with pytest.raises(ValueError, match=r"share \(1.5\).*\[0, 1\]"):
        decoding_state_noise(tiny_model, batch, share=1.5)


def test_clover_trainer_trains_with_decoding_states(tiny_model, tmp_path, monkeypatch):
    import clover.trainer_clover as training

    calls = []
    real = training.decoding_state_noise
    monkeypatch.setattr(
        training, "decoding_state_noise", lambda *a, **k: calls.append((a[2], k["keep_wrong_masked"])) or real(*a, **k)
    )
    collator = CloverDataCollator(PAD, tiny_model.config.block_size, seed=0)
    args = _training_args(tmp_path, max_steps=3)
    trainer = CloverTrainer(
        model=tiny_model,
        args=args,
        train_dataset=_copy_task(24),
        data_collator=collator,
        decoding_state_share=0.5,
        decoding_state_keep_wrong=True,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert calls == [(0.5, True)] * 3
    with pytest.raises(ValueError, match=r"decoding_state_share \(2.0\)"):
        CloverTrainer(model=tiny_model, args=args, data_collator=collator, decoding_state_share=2.0)


def test_clover_trainer_trains_a_layer_at_its_own_learning_rate(tiny_model, tmp_path):
    # Every layer at learning rate 0 but layer 1: only layer 1 moves, and the schedule scales its rate too.
    before = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    collator = CloverDataCollator(PAD, tiny_model.config.block_size, seed=0)
    args = _training_args(
        tmp_path,
        max_steps=3,
        learning_rate=0.0,
        weight_decay=0.1,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=4,
    )
    trainer = CloverTrainer(
        model=tiny_model,
        args=args,
        train_dataset=_copy_task(24),
        data_collator=collator,
        layer_learning_rates={1: 1e-2},
    )
    trainer.train()
    moved = {name for name, p in tiny_model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and moved == {name for name in before if name.startswith("model.layers.1.")}
    rates = sorted({group["lr"] for group in trainer.optimizer.param_groups})
    assert rates == [0.0, pytest.approx(1e-2 * 3 / 4)]  # 3 of the 4 warm-up steps taken
    assert {group["weight_decay"] for group in trainer.optimizer.param_groups} == {0.0, 0.1}  # norms keep no decay
    with pytest.raises(ValueError, match=r"names layers \[7\], but the model has layers 0-3"):
        CloverTrainer(model=tiny_model, args=args, data_collator=collator, layer_learning_rates={7: 1e-3})


def test_train_script_reads_layer_learning_rates(train_script):
    args = train_script.parse_args(["--model", "m", "--data", "d", "--output", "o", "--layer-lr", "4=1e-3"])
    assert args.layer_lr == [(4, 1e-3)]
    with pytest.raises(SystemExit):
        train_script.parse_args(["--model", "m", "--data", "d", "--output", "o", "--layer-lr", "4"])


def test_collator_weights_the_tail_after_eos_as_one_token():
    # Row 0: 6 answer tokens in blocks of 4 -> 2 tail pads; row 1: 2 answer tokens -> 2 tail pads, then a block
    # that row never reaches (unsupervised, weight 0).
    features = [
        {"prompt_ids": [5, 6, 7], "answer_ids": [10, 11, 12, 13, 14, EOS]},
        {"prompt_ids": [8], "answer_ids": [20, EOS]},
    ]
    batch = CloverDataCollator(pad_token_id=PAD, block_size=4)(features)
    torch.testing.assert_close(batch["label_weights"], torch.tensor([
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 0.5, 0.5],
        [0, 0, 0, 1, 1, 0.5, 0.5, 0, 0, 0, 0],
    ]))  # fmt: skip
    # The tail is noised like the answer: a pad is masked at its block's rate, so a visible one means "ended".
    assert not (batch["noise_mask"] & (batch["labels"] == -100)).any()


def test_collator_tail_mask_keeps_the_tail_masked_and_unsupervised():
    features = [{"prompt_ids": [8], "answer_ids": [20, EOS]}, {"prompt_ids": [5, 6], "answer_ids": [1, 2, 3, EOS]}]
    batch = CloverDataCollator(pad_token_id=PAD, block_size=4, tail="mask", mask_token_id=MASK)(features)
    tail = torch.tensor([[False, False, False, False, True, True], [False] * 6])
    assert bool(batch["noise_mask"][tail].all())  # always <|mask|> in the noisy copy
    assert bool((batch["labels"][tail] == -100).all()) and bool((batch["label_weights"][tail] == 0).all())
    assert bool((batch["input_ids"][tail] == PAD).all())  # the clean stream holds pad, as a committed block does
    with pytest.raises(ValueError, match="tail='mask' needs mask_token_id"):
        CloverDataCollator(pad_token_id=PAD, block_size=4, tail="mask")


def _copy_task(num: int, seed: int = 0) -> list[dict]:
    """Answer = each prompt token + 60, then EOS: learnable from the prompt by a tiny model."""
    generator = torch.Generator().manual_seed(seed)
    features = []
    for _ in range(num):
        prompt = torch.randint(1, 60, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
        features.append({"prompt_ids": prompt.tolist(), "answer_ids": (prompt + 60).tolist() + [EOS]})
    return features


def _training_args(tmp_path, **overrides) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**defaults, **overrides})


@torch.no_grad()
def _fixed_batch_loss(model, batch) -> float:
    was_training = model.training
    model.eval()
    loss = float(model(**batch).loss)
    model.train(was_training)
    return loss


def test_trainer_trains_a_tiny_clover_and_the_loss_decreases(tiny_model, tmp_path):
    collator = CloverDataCollator(PAD, tiny_model.config.block_size, seed=0)
    held_out = CloverDataCollator(PAD, tiny_model.config.block_size, seed=123)(_copy_task(16, seed=1))
    before = _fixed_batch_loss(tiny_model, held_out)
    args = _training_args(tmp_path, num_train_epochs=6)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=_copy_task(32), data_collator=collator)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 24 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    after = _fixed_batch_loss(tiny_model, held_out)
    assert after < 0.8 * before, (before, after)


def test_trainer_gradient_accumulation_logs_the_mean_micro_batch_loss(tiny_model, tmp_path):
    features = _copy_task(1) * 4  # identical examples: the order Trainer draws them in does not matter
    block_size = tiny_model.config.block_size
    reference = CloverDataCollator(PAD, block_size, seed=0)  # replays the noise Trainer's collator will draw
    micro_losses = [_fixed_batch_loss(tiny_model, reference(features[:2])) for _ in range(2)]
    args = _training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1)
    collator = CloverDataCollator(PAD, block_size, seed=0)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=features, data_collator=collator)
    trainer.train()
    logged = trainer.state.log_history[0]["loss"]
    assert logged == pytest.approx(sum(micro_losses) / 2, rel=1e-3), (logged, micro_losses)


def test_trainer_with_gradient_checkpointing_gives_a_finite_loss(tiny_model, tmp_path):
    collator = CloverDataCollator(PAD, tiny_model.config.block_size, seed=0)
    args = _training_args(tmp_path, gradient_checkpointing=True, max_steps=2)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=_copy_task(16), data_collator=collator)
    trainer.train()
    assert all(layer.gradient_checkpointing for layer in tiny_model.model.layers)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


# --------------------------------------------------------------------------------------------------------------------
# scripts/train.py on the demo checkpoint
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_script():
    spec = importlib.util.spec_from_file_location("clover_train_script", REPO / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO, trust_remote_code=True)


def _load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


def _repeat_record(word: str) -> dict:
    messages = [
        {"role": "user", "content": f"Repeat the word: {word}"},
        {"role": "assistant", "content": f"{word} {word} {word}"},
    ]
    return {"messages": messages, "enable_thinking": False}


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@torch.no_grad()
def _greedy_answers(model, tokenizer, words) -> list[str]:
    answers = []
    for word in words:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat the word: {word}"}],
            add_generation_prompt=True,
            enable_thinking=False,
            tokenize=False,
        )
        ids = torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


LORA_RUN = ["--lora", "8", "--lr", "1e-2", "--epochs", "3", "--batch-size", "8", "--seed", "0"]


@pytest.fixture(scope="module")
def repeat_task(tmp_path_factory, train_script, demo_tokenizer):
    """64 'Repeat the word' chats, the demo's greedy answers before, and a merged LoRA fine-tune on them."""
    root = tmp_path_factory.mktemp("repeat")
    data = _write_jsonl(root / "repeat.jsonl", [_repeat_record(WORDS[i % len(WORDS)]) for i in range(64)])
    before = _greedy_answers(_load(DEMO), demo_tokenizer, WORDS[:4])
    merged = root / "merged"
    train_script.main(["--model", str(DEMO), "--data", str(data), "--output", str(merged), *LORA_RUN])
    return SimpleNamespace(root=root, data=data, before=before, merged=merged)


def test_lora_targets_the_fused_expert_parameters(demo_tokenizer):
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    model = apply_lora(_load(DEMO), 8)
    layers = model.base_model.model.model.layers
    for layer in layers:
        wrapped = {m.parameter_name for m in layer.mlp.experts.modules() if isinstance(m, ParamWrapper)}
        assert wrapped == {"gate_up_proj", "down_proj"}
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert adapted == set(LORA_MODULES) | {"experts", "base_layer"}  # base_layer: the nested wrapper

    # lora_B starts at zero, so its gradient is (upstream x lora_A input): non-zero only if the forward really
    # runs through the experts' adapters.
    records = [_repeat_record(word) for word in WORDS[:4]]
    features = [encode_chat_example(demo_tokenizer, r, 1024) for r in records]
    batch = CloverDataCollator(demo_tokenizer.pad_token_id, model.config.block_size, seed=0)(features)
    model.train()
    model(**batch).loss.backward()
    expert_b = [p for name, p in model.named_parameters() if ".experts." in name and "lora_B" in name]
    assert len(expert_b) == 2 * len(layers)
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in expert_b)


def test_lora_fine_tune_changes_the_greedy_answers(repeat_task, demo_tokenizer):
    after = _greedy_answers(_load(repeat_task.merged), demo_tokenizer, WORDS[:4])
    assert after != repeat_task.before, after


def test_lora_fine_tune_lowers_the_task_loss(repeat_task, train_script, demo_tokenizer):
    records = [_repeat_record(word) for word in WORDS]
    features = [encode_chat_example(demo_tokenizer, r, 1024) for r in records]
    block_size = json.loads((DEMO / "config.json").read_text())["block_size"]
    batch = CloverDataCollator(demo_tokenizer.pad_token_id, block_size, seed=123, complementary=True)(features)
    before, after = _fixed_batch_loss(_load(DEMO), batch), _fixed_batch_loss(_load(repeat_task.merged), batch)
    assert after < 0.95 * before, (before, after)


def test_merged_output_is_a_plain_clover_checkpoint_with_the_experts_tuned(repeat_task):
    merged, base = _load(repeat_task.merged), _load(DEMO)
    assert type(merged).__name__ == "CloverForBlockDiffusion"
    assert type(merged).__module__.startswith("transformers_modules")
    config = json.loads((repeat_task.merged / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert all((repeat_task.merged / name).is_file() for name in CODE_FILES)
    merged_state, base_state = merged.state_dict(), base.state_dict()
    assert merged_state.keys() == base_state.keys()  # no lora_* / base_layer left
    changed = {name for name in base_state if not torch.equal(merged_state[name], base_state[name])}
    assert "model.layers.0.mlp.experts.gate_up_proj" in changed and "model.layers.3.mlp.experts.down_proj" in changed
    assert (
        "model.layers.3.self_attn.q_proj.weight" in changed and "model.layers.0.linear_attn.out_proj.weight" in changed
    )
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" not in changed  # frozen under LoRA


def test_keep_adapter_saves_an_adapter_that_merges_to_the_same_weights(repeat_task, train_script):
    from peft import PeftModel

    adapter = repeat_task.root / "nested" / "adapter"  # a parent that does not exist yet
    argv = ["--model", str(DEMO), "--data", str(repeat_task.data), "--output", str(adapter), *LORA_RUN]
    train_script.main([*argv, "--keep-adapter"])
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    assert not list(adapter.parent.glob(".clover-train-*"))
    loaded = PeftModel.from_pretrained(_load(DEMO), adapter)
    assert any(".experts." in name and "lora_B" in name for name, _ in loaded.named_parameters())
    # Same seed, same data: the run is reproducible, so merging this adapter gives the merged run's weights.
    merged_here = loaded.merge_and_unload().state_dict()
    shipped = _load(repeat_task.merged).state_dict()
    for name, tensor in shipped.items():
        torch.testing.assert_close(merged_here[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


class _StandInHub:
    """Receives create_repo / create_commit in place of huggingface.co and writes the files to `root/repo_id`."""

    def __init__(self, root: Path):
        self.root = root
        self.commits = []

    def create_repo(self, *args, **kwargs):
        repo_id = kwargs.get("repo_id") or args[-1]
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, *args, repo_id, operations, **kwargs):
        for operation in operations:
            target = self.root / repo_id / operation.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(operation.path_or_fileobj, target)
        self.commits.append((repo_id, sorted(op.path_in_repo for op in operations)))
        return SimpleNamespace(commit_url=f"file://{self.root / repo_id}", oid="0" * 40)


@pytest.fixture
def stand_in_hub(tmp_path, monkeypatch):
    import huggingface_hub
    import transformers.utils.hub as transformers_hub
    from huggingface_hub.errors import EntryNotFoundError

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)  # whatever HTTP client huggingface_hub uses
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    hub = _StandInHub(tmp_path / "hub")

    def card_not_found(*args, **kwargs):
        raise EntryNotFoundError("README.md")  # a fresh repo: transformers writes a template card

    monkeypatch.setattr(huggingface_hub.ModelCard, "load", card_not_found)
    for name in ("create_repo", "create_commit"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, getattr(hub, name))  # transformers >= 5.2x: hf_api()
        if hasattr(transformers_hub, name):  # older releases import the module-level functions
            monkeypatch.setattr(transformers_hub, name, getattr(hub, name))
    return hub


def test_push_to_hub_uploads_a_loadable_remote_code_checkpoint(train_script, stand_in_hub, tmp_path):
    data = _write_jsonl(tmp_path / "small.jsonl", [_repeat_record(word) for word in WORDS[:8]])
    output = tmp_path / "out"
    argv = ["--model", str(DEMO), "--data", str(data), "--output", str(output), "--epochs", "1"]
    train_script.main([*argv, "--push-to-hub", "user/clover-test"])

    pushed = stand_in_hub.root / "user" / "clover-test"
    assert [repo for repo, _ in stand_in_hub.commits] == ["user/clover-test"] * 2  # the model, then the tokenizer
    config = json.loads((pushed / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    for name in CODE_FILES:  # the checkpoint's own code travels with it
        assert (pushed / name).read_bytes() == (DEMO / name).read_bytes(), name
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (pushed / name).is_file(), name
    loaded = _load(pushed)
    assert type(loaded).__module__.startswith("transformers_modules")
    saved = _load(output).state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], msg=name)
    assert AutoTokenizer.from_pretrained(pushed, trust_remote_code=True).mask_token == "<|mask|>"


def _good_lines(n: int = 2) -> list[dict]:
    return [_repeat_record(word) for word in WORDS[:n]]


BAD_LINE_3 = {
    "malformed JSON": ('{"messages": [{"role": "user", "content": "hi"}', [], r":3: not valid JSON"),
    "too long": (_repeat_record(" ".join(WORDS * 4)), ["--max-length", "64"], r"line 3: the example has \d+ tokens"),
    "empty answer": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        [],
        r":3: the assistant reply is empty",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINE_3))
def test_bad_training_data_exits_naming_the_line(case, train_script, tmp_path):
    bad, extra, message = BAD_LINE_3[case]
    data = _write_jsonl(tmp_path / "bad.jsonl", [*_good_lines(), bad])
    output = tmp_path / "out"
    with pytest.raises(ValueError) as excinfo:  # the script's entry point turns it into one line and status 2
        train_script.main(["--model", str(DEMO), "--data", str(data), "--output", str(output), *extra])
    assert re.search(message, str(excinfo.value)), str(excinfo.value)
    assert not output.exists()


def _old_output(path: Path) -> dict[str, bytes]:
    path.mkdir()
    files = {"config.json": b'{"old": true}', "model.safetensors": b"old weights"}
    for name, content in files.items():
        (path / name).write_bytes(content)
    return files


CHAT_RECORDS = [
    {"messages": [{"role": "user", "content": "Sort 3 1 2"}, {"role": "assistant", "content": "1, 2, 3"}],
     "enable_thinking": False},
    {"messages": [{"role": "user", "content": "Sort 3 1 2"},
                  {"role": "assistant", "content": "1, 2, 3", "reasoning_content": "three numbers"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}],
     "enable_thinking": False},
]  # fmt: skip


@pytest.mark.parametrize("record", CHAT_RECORDS, ids=["thinking off", "thinking on", "tool call, two turns"])
def test_the_templates_assistant_mask_is_the_answer_train_py_trains(demo_tokenizer, record):
    """`{% generation %}` marks what TRL's assistant_only_loss supervises: the last reply must be exactly
    encode_chat_example's answer (from where the generation prompt ends through <|im_end|>)."""
    rendered = demo_tokenizer.apply_chat_template(
        record["messages"], enable_thinking=record.get("enable_thinking", True), return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    ids, mask = rendered["input_ids"], rendered["assistant_masks"]
    runs, start = [], None
    for i, marked in enumerate([*mask, 0]):
        if marked and start is None:
            start = i
        elif not marked and start is not None:
            runs.append(ids[start:i])
            start = None
    encoded = encode_chat_example(demo_tokenizer, record, 1024)
    assert runs[-1] == encoded["answer_ids"]
    assert ids[: len(encoded["prompt_ids"])] == encoded["prompt_ids"]
    assert len(runs) == sum(m["role"] == "assistant" for m in record["messages"])


def test_parallel_encoding_gives_the_sequential_encoding_in_order(demo_tokenizer):
    from clover.chat_data_clover import encode_chat_examples

    records = [_repeat_record(WORDS[i % len(WORDS)] + " " * (i % 3)) for i in range(2400)]
    parallel = encode_chat_examples(demo_tokenizer, records, 1024, processes=2)
    assert parallel == [encode_chat_example(demo_tokenizer, record, 1024) for record in records]


def test_existing_output_is_refused_without_force(train_script, tmp_path):
    output = tmp_path / "out"
    old = _old_output(output)
    data = _write_jsonl(tmp_path / "data.jsonl", _good_lines())
    with pytest.raises(ValueError, match="exists and is not empty; pass --force"):
        train_script.main(["--model", str(DEMO), "--data", str(data), "--output", str(output)])
    assert {p.name: p.read_bytes() for p in output.iterdir()} == old


def test_failed_run_leaves_the_previous_output_untouched(train_script, tmp_path, monkeypatch):
    output = tmp_path / "out"
    old = _old_output(output)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*_good_lines(), "not json"])
    with pytest.raises(ValueError, match=":3:"):
        train_script.main(["--model", str(DEMO), "--data", str(bad), "--output", str(output), "--force"])
    assert {p.name: p.read_bytes() for p in output.iterdir()} == old

    def crash(self, *args, **kwargs):
        raise RuntimeError("training crashed")

    monkeypatch.setattr(Trainer, "train", crash)
    good = _write_jsonl(tmp_path / "good.jsonl", _good_lines())
    with pytest.raises(RuntimeError, match="training crashed"):
        train_script.main(["--model", str(DEMO), "--data", str(good), "--output", str(output), "--force"])
    assert {p.name: p.read_bytes() for p in output.iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "out"]  # no work dir left


def test_force_keeps_the_previous_output_when_the_swap_fails(train_script, tmp_path, monkeypatch):
    """--force replaces the output only once the new model is complete; the swap itself moves the old one aside
    first, so a failure (or a kill) between removing the old and placing the new one cannot lose both."""
    output = tmp_path / "out"
    old = _old_output(output)
    data = _write_jsonl(tmp_path / "data.jsonl", _good_lines(4))
    rename = Path.rename

    def failing_rename(self, target):
        if Path(target) == output and self.name == "model":  # the finished model, moved into place
            raise OSError("disk full")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    run = ["--data", str(data), "--batch-size", "2", "--max-steps", "1", "--seed", "0", "--force"]
    with pytest.raises(OSError, match="disk full"):
        train_script.main(["--model", str(DEMO), *run, "--output", str(output)])
    assert {p.name: p.read_bytes() for p in output.iterdir()} == old


def test_a_checkpoint_is_a_model_to_train_on_and_a_tokenizerless_one_is_named(train_script, demo_tokenizer, tmp_path):
    data = _write_jsonl(tmp_path / "data.jsonl", _good_lines(4))
    run = ["--data", str(data), "--batch-size", "2", "--max-steps", "2", "--save-steps", "2", "--seed", "0"]
    checkpoints = tmp_path / "checkpoints"
    train_script.main(
        ["--model", str(DEMO), *run, "--output", str(tmp_path / "a"), "--checkpoint-dir", str(checkpoints)]
    )
    checkpoint = checkpoints / "checkpoint-2"
    assert (checkpoint / "tokenizer_config.json").is_file()
    train_script.main(["--model", str(checkpoint), *run, "--output", str(tmp_path / "b")])  # a run goes on from it
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "b", trust_remote_code=True).get_vocab() == demo_tokenizer.get_vocab()
    )

    for name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        (checkpoint / name).unlink(missing_ok=True)  # a checkpoint written without its tokenizer
    with pytest.raises(ValueError, match=r"No tokenizer at .*checkpoint-2 \(--model; .*pass --tokenizer DIR"):
        train_script.main(["--model", str(checkpoint), *run, "--output", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()
    train_script.main(["--model", str(checkpoint), "--tokenizer", str(DEMO), *run, "--output", str(tmp_path / "c")])
    assert (tmp_path / "c" / "tokenizer_config.json").is_file()
