"""Fine-tuning Clover with the block-diffusion objective: batches for `model(**batch)` and `transformers.Trainer`.

A batch lines up every row's answer at the same column (prompts left-padded), splits the answers into blocks of
`block_size` (right-padded to whole blocks) and draws the noise from a seeded generator:

    input_ids     [pad pad p p p | a a a a  a a eos pad | ...]
    block_ids     [ -1  -1 -1 -1 -1 |  0 0 0 0  1 1  1   1 | ...]
    labels        [-100 ...          |  a a a a  a a eos pad]   the tail after EOS, to the block end, is pad
    label_weights [0 ...             |  1 1 1 1  1 1  1  1/n]   ... and the whole tail counts as one token
    noise_mask    which supervised tokens become <|mask|>, at a rate t ~ U(eps, 1) drawn per block

Why the tail is weighted down (measured on a copy/reverse task at the demo model's width, AdamW 3e-3, batch 64):
an answer of 3-8 words padded to a 32-token block is about 80% padding. Supervised like the answer, the padding
stalls learning of the content: held-out word accuracy stays at chance (1-2% after 100 causal steps, where the
unpadded answer reaches 77-89%), and the same happens to transformers' Llama and Qwen3.5-MoE of that width, with
another token id for the padding and with the tail hidden from attention, so it is the loss, not the model. The
padding is learnt in a few steps (its gradient is 20x the content's at the first step) and the model then learns
the content slowly; switched on only after 60 steps, the same tail does no harm. Weighted to count as one token,
the tail costs little (57% after 100 steps), and the model still learns that a finished row stays pad: at
inference it commits the tail with confidence, so a finished row's tail costs no extra denoising steps, and the
tail is noised like the answer, so a visible pad means what it means at inference (the answer ended before it).
`tail="mask"` instead keeps the tail as `<|mask|>` and never supervises it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from .generation_clover import select_positions_to_commit
from .modeling_clover import block_diffusion_layout, draw_block_noise, example_block_noise


@dataclass
class CloverDataCollator:
    """Collates `{"prompt_ids": [...], "answer_ids": [...]}` features into a block-diffusion training batch.

    Args:
        pad_token_id: id used for padding (and supervised after the answer's EOS up to its block end).
        block_size: the model's `config.block_size`.
        tail: what the positions after the answer's EOS, up to the end of its last block, are: `"pad"` (pad,
            supervised, the whole tail weighted as one token) or `"mask"` (always `<|mask|>`, never supervised;
            needs `mask_token_id`).
        mask_token_id: the model's `config.mask_token_id` (only for `tail="mask"`).
        seed: seeds the noise generator, so a run is reproducible.
        complementary: also train every example with the complement of its mask (rate 1 - t): each token is
            then seen masked exactly once per pair, which lowers the variance of the loss.
        eps: the smallest noise level.
        suffix_prob: the share of blocks masked as a suffix (their last ceil(t * n) supervised tokens) rather than
            uniformly: the clean-prefix states that decoding, which commits mostly from the left, goes through
            (see `draw_block_noise`).
        per_example_noise: draw each row's noise from its own generator, seeded by (seed, the feature's
            `"example_index"`, `epoch`), instead of one generator per batch. The noise of an example then depends
            neither on the batch it lands in nor on the number of processes training: N processes with batch B
            draw the masks one process with batch N x B draws, and a resumed run draws the masks of an
            uninterrupted one with no counter to restore. Every feature needs an integer `"example_index"`; set
            `epoch` at each epoch (`ExampleNoiseEpoch` does it for Trainer).
    """

    pad_token_id: int
    block_size: int
    seed: int = 0
    complementary: bool = False
    eps: float = 1e-3
    tail: str = "pad"
    mask_token_id: int | None = None
    per_example_noise: bool = False
    suffix_prob: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.suffix_prob <= 1.0:
            raise ValueError(f"suffix_prob ({self.suffix_prob!r}) is a share of the blocks: pick it in [0, 1].")
        if self.tail not in ("pad", "mask"):
            raise ValueError(f"tail ({self.tail!r}) must be 'pad' (supervised, weighted as one token) or 'mask'.")
        if self.tail == "mask" and self.mask_token_id is None:
            raise ValueError("tail='mask' needs mask_token_id (the model's config.mask_token_id).")
        self.calls = 0  # batches collated so far: the noise of batch i depends on (seed, i) only
        self.epoch = 0  # per_example_noise: the epoch the examples are drawn for

    def next_generator(self) -> torch.Generator:
        """The noise generator of the next batch, seeded by (seed, batch index): a run resumed at batch i (set
        `calls = i`) draws the masks an uninterrupted run would, and every batch gets fresh noise."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        return generator

    def example_generator(self, example_index: int) -> torch.Generator:
        """The noise generator of one example in this epoch, seeded by (seed, example index, epoch) only."""
        key = f"{self.seed}:{example_index}:{self.epoch}".encode()
        return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1)

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        features = unpack_batch(features)
        for i, feature in enumerate(features):
            if self.per_example_noise and not isinstance(feature.get("example_index"), int):
                raise ValueError(
                    f"Example {i} has no integer 'example_index' (got {feature.get('example_index')!r}): "
                    "per_example_noise seeds each example's noise by its index; number the examples first "
                    "(e.g. with `number_examples`)."
                )
            if len(feature["prompt_ids"]) == 0:
                raise ValueError(f"Example {i} has an empty prompt; block diffusion conditions on a prompt.")
            if len(feature["answer_ids"]) == 0:
                raise ValueError(f"Example {i} has an empty answer: there is nothing to learn from it.")
        bs = self.block_size
        examples = [(list(f["prompt_ids"]), list(f["answer_ids"])) for f in features]
        layout = block_diffusion_layout(examples, self.pad_token_id, bs, self.tail)
        labels, block_ids, tail_mask = layout["labels"], layout["block_ids"], layout.pop("tail_mask")
        if self.per_example_noise:
            generators = [self.example_generator(f["example_index"]) for f in features]
            lengths = [len(answer) for _, answer in examples]
            noise_mask, noise_level = example_block_noise(layout, lengths, bs, generators, self.eps, self.suffix_prob)
        else:
            noise_mask, noise_level = draw_block_noise(
                labels != -100, block_ids, bs, self.next_generator(), self.eps, self.suffix_prob
            )
        noise_mask |= tail_mask
        batch_out = layout | {"noise_mask": noise_mask, "noise_level": noise_level}
        if self.complementary:
            complement = ((labels != -100) & ~noise_mask) | tail_mask
            complement_level = torch.where(block_ids >= 0, (1 - noise_level).clamp(min=self.eps), noise_level)
            batch_out = {key: torch.cat([value, value]) for key, value in batch_out.items()}
            batch_out["noise_mask"] = torch.cat([noise_mask, complement])
            batch_out["noise_level"] = torch.cat([noise_level, complement_level])
        return batch_out


# LoRA targets: every projection of the attention, Gated DeltaNet and shared expert layers, and the fused 3D experts,
# which are parameters, not nn.Linear (peft's `target_parameters`). The routers and gates stay frozen.
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj",
                "down_proj"]  # fmt: skip
LORA_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def clover_lora_config(rank: int, **overrides):
    """A peft `LoraConfig` over `LORA_MODULES` and `LORA_EXPERT_PARAMETERS`, alpha = 2 x rank, no dropout."""
    from peft import LoraConfig

    options = {"r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": LORA_MODULES}
    return LoraConfig(**(options | {"target_parameters": LORA_EXPERT_PARAMETERS} | overrides))


def number_examples(features: Sequence[dict], start: int = 0) -> list[dict]:
    """Copies of `features` with `"example_index"` = start, start + 1, ...: the key of each example's noise under
    `CloverDataCollator(per_example_noise=True)`."""
    return [{**feature, "example_index": start + i} for i, feature in enumerate(features)]


class ExampleNoiseEpoch(TrainerCallback):
    """Tells a `per_example_noise` collator the epoch at the start of each one (a resumed run included), so an
    example seen again in a later epoch gets fresh noise and a resumed run draws the masks an uninterrupted one
    would."""

    def __init__(self, collator: CloverDataCollator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch + 1e-6)  # state.epoch: epochs done, with the fraction of this one


def supervised_weight(batch: dict) -> torch.Tensor:
    """The loss normaliser of a Clover batch: its supervised tokens, weighted by `label_weights` (the padding after
    an answer's EOS counts as one token), as `CloverForBlockDiffusion`'s loss divides by."""
    supervised = batch["labels"] != -100
    if batch.get("label_weights") is None:
        return supervised.sum().float()
    return batch["label_weights"].masked_fill(~supervised, 0).sum().float()


@torch.no_grad()
def decoding_state_noise(
    model,
    batch: dict,
    share: float,
    generator: torch.Generator | None = None,
    max_forwards: int = 4,
    threshold: float = 0.95,
    min_level: float = 0.1,
    keep_wrong_masked: bool = False,
) -> dict:
    """Replaces the noise of a `share` of the answer blocks by a state that LowConfidence decoding meets.

    Such a block starts all masked; then 1 to `max_forwards` forwards of `model` (drawn per block, no gradient)
    each unmask what the decoding rule would commit (every masked position whose most likely token has probability
    >= `threshold`, and at least the most confident one), writing the true token, as if decoding had been right so
    far. The loss then scores what is still masked, with the masked share of the block's supervised tokens (at
    least `min_level`) as its t. Uniform noise masks at random; these states keep masked what the model is least
    sure of, as decoding does. Measured on the demo model (README, the shipped tiny model): half the blocks so gave
    18 more points of addition at 0.95 than uniform noise over the same 250 steps. With `keep_wrong_masked`, a
    position the rule would commit with a wrong token stays masked (decoding would have committed the error), so
    the loss scores the confident mistakes that cost exact match below threshold 1, in the state that made them. (CloverTrainer draws the blocks
    from a generator seeded by the run's seed; a resumed run draws others.)

    Returns a new batch (the input is not changed); positions masked whatever the noise (the tail of
    `tail="mask"`) stay masked."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share ({share}) must lie in [0, 1]: the fraction of answer blocks in a decoding state.")
    if share == 0.0:
        return batch
    clover = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the LoRA layers stay
    config, block_size = clover.config, clover.config.block_size
    input_ids, labels, block_ids = batch["input_ids"], batch["labels"], batch["block_ids"]
    start = int((block_ids >= 0).any(dim=0).float().argmax())  # the answer columns (aligned across rows)
    supervised = (labels != -100)[:, start:]
    always = batch["noise_mask"][:, start:] & ~supervised
    rows, num_blocks = supervised.shape[0], supervised.shape[1] // block_size
    device = input_ids.device
    forwards = torch.randint(1, max_forwards + 1, (rows, num_blocks), generator=generator).to(device)
    chosen = torch.rand(rows, num_blocks, generator=generator).to(device) < share
    masked = supervised & chosen.repeat_interleave(block_size, dim=1)
    was_training = clover.training
    clover.eval()
    try:
        for forward in range(max_forwards):
            running = (forwards > forward).repeat_interleave(block_size, dim=1) & masked
            if not bool(running.any()):
                break
            noisy = torch.where(masked | always, config.mask_token_id, input_ids[:, start:])
            hidden = clover.model(
                input_ids=input_ids,
                attention_mask=batch.get("attention_mask"),
                block_ids=block_ids,
                noisy_input_ids=noisy,
                use_cache=False,
            ).last_hidden_state[:, input_ids.shape[1] :]
            logits = clover.lm_head(hidden[running]).float()
            logits[:, config.mask_token_id] = float("-inf")
            confidence = torch.full(masked.shape, -1.0, device=device)
            probability, candidate = logits.softmax(dim=-1).max(dim=-1)
            confidence[running] = probability
            commit = select_positions_to_commit(
                confidence.view(-1, block_size), running.reshape(-1, block_size), threshold
            ).view_as(masked)
            if keep_wrong_masked:  # commit only where the candidate is the true token
                commit[running] &= candidate == input_ids[:, start:][running]
            masked &= ~commit
    finally:
        clover.train(was_training)
    in_chosen = chosen.repeat_interleave(block_size, dim=1)
    counts = supervised.view(rows, num_blocks, block_size).sum(-1).clamp(min=1)
    level = (masked.view(rows, num_blocks, block_size).sum(-1) / counts).clamp(min=min_level)
    noise_mask, noise_level = batch["noise_mask"].clone(), batch["noise_level"].clone()
    noise_mask[:, start:] = torch.where(in_chosen, masked | always, noise_mask[:, start:])
    noise_level[:, start:] = torch.where(in_chosen, level.repeat_interleave(block_size, dim=1), noise_level[:, start:])
    return {**batch, "noise_mask": noise_mask, "noise_level": noise_level}


class CloverTrainer(Trainer):
    """`transformers.Trainer` whose training loss is the mean over the supervised tokens of the whole optimizer
    step: every micro-batch of the gradient accumulation on every process, not the mean of per-batch means.

    `CloverForBlockDiffusion` divides each batch's loss by that batch's (weighted) supervised tokens. Trainer
    divides by the accumulation steps and data parallelism averages over processes, so a batch with few tokens
    would weigh as much as one with many, and N processes with batch B would not train like one process with
    batch N x B. Here each batch's loss is rescaled by its share of the step's weighted tokens, summed over
    processes (Trainer's `num_items_in_batch` count, weighted like the model's loss): the gradient is then that of
    one batch holding all of them, whatever the number of processes and accumulation steps. The router's
    auxiliary loss, a statistic of each batch, is averaged with the same weights.
    """

    def __init__(
        self,
        *args,
        decoding_state_share: float = 0.0,
        decoding_state_keep_wrong: bool = False,
        layer_learning_rates: dict[int, float] | None = None,
        **kwargs,
    ):
        """`decoding_state_share`: the fraction of answer blocks trained in a state LowConfidence decoding meets
        instead of under the collator's noise (`decoding_state_noise`; training steps only);
        `decoding_state_keep_wrong`: in those states a position the rule would commit wrongly stays masked;
        `layer_learning_rates`: {layer index: peak learning rate} for decoder layers that should not train at
        `args.learning_rate` (say, layers just added to a trained model); the schedule scales every rate alike."""
        super().__init__(*args, **kwargs)
        if not 0.0 <= decoding_state_share <= 1.0:
            raise ValueError(f"decoding_state_share ({decoding_state_share}) must lie in [0, 1].")
        self.decoding_state_share = decoding_state_share
        self.decoding_state_keep_wrong = decoding_state_keep_wrong
        self.layer_learning_rates = dict(layer_learning_rates or {})
        num_layers = self.accelerator.unwrap_model(self.model).config.num_hidden_layers
        unknown = sorted(i for i in self.layer_learning_rates if not 0 <= i < num_layers)
        if unknown:
            raise ValueError(
                f"layer_learning_rates names layers {unknown}, but the model has layers 0-{num_layers - 1}."
            )
        self._decoding_state_generator = torch.Generator().manual_seed(self.args.seed)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return batch_samples, None
        total = sum(supervised_weight(batch) for batch in batch_samples).to(device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return batch_samples, total

    def create_optimizer(self, *args, **kwargs):
        """Trainer's optimizer, each parameter group split by `layer_learning_rates` (made before any step, so
        there is no state to move; a resumed run with the same rates finds the same groups)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if not self.layer_learning_rates:
            return optimizer
        rate_of = {}
        for name, parameter in self.model.named_parameters():
            found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if found and int(found.group(1)) in self.layer_learning_rates:
                rate_of[id(parameter)] = self.layer_learning_rates[int(found.group(1))]
        groups = []
        for group in optimizer.param_groups:
            by_rate: dict[float, list] = {}
            for parameter in group["params"]:
                by_rate.setdefault(rate_of.get(id(parameter), group["lr"]), []).append(parameter)
            groups.extend({**group, "params": params, "lr": rate} for rate, params in by_rate.items())
        optimizer.param_groups = groups
        return optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        # transformers 5.2 loads a resumed optimizer with map_location=args.device, which is "cpu:0" on several CPU
        # processes, a location torch.load has no deserializer for: give it one (an indexed CPU is the CPU).
        if checkpoint is not None and self.args.device.type == "cpu" and self.args.world_size > 1:
            _accept_indexed_cpu_locations()
        return super()._load_optimizer_and_scheduler(checkpoint)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.decoding_state_share and model.training and "noise_mask" in inputs:
            unwrapped = self.accelerator.unwrap_model(model)
            inputs = decoding_state_noise(
                unwrapped,
                inputs,
                self.decoding_state_share,
                self._decoding_state_generator,
                keep_wrong_masked=self.decoding_state_keep_wrong,
            )
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if num_items_in_batch is not None:  # training: Trainer then divides by the accumulation steps
            share = supervised_weight(inputs).to(loss.device) / num_items_in_batch.clamp(min=1e-6)
            loss = loss * share * self.accelerator.num_processes * self.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss


_INDEXED_CPU_REGISTERED = []


def _accept_indexed_cpu_locations() -> None:
    if not _INDEXED_CPU_REGISTERED:
        torch.serialization.register_package(
            11, lambda storage: None, lambda obj, location: obj if location.startswith("cpu:") else None
        )
        _INDEXED_CPU_REGISTERED.append(True)


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


def token_budget_batches(
    features: Sequence[dict], max_tokens: int, seed: int = 0, block_size: int = 1
) -> list[list[dict]]:
    """Groups features into batches of similar length whose padded size (rows x longest prompt + answer, answers
    rounded up to whole blocks) stays within `max_tokens`, in a seeded random order. Every step then costs about the
    same, whatever the mix of short and long examples."""

    def padded_length(feature: dict) -> int:
        return len(feature["prompt_ids"]) + -(-len(feature["answer_ids"]) // block_size) * block_size

    order = sorted(range(len(features)), key=lambda i: padded_length(features[i]))
    batches, current, longest = [], [], 0
    for index in order:
        length = padded_length(features[index])
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(features[index])
        longest = max(longest, length)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def unpack_batch(features: Sequence) -> Sequence[dict]:
    """A DataLoader over `token_budget_batches` (batch size 1) hands a collator `[batch]`: unwrap it."""
    if len(features) == 1 and isinstance(features[0], (list, tuple)):
        return features[0]
    return features


def read_chat_jsonl(path: str | Path) -> list[dict]:
    """Reads a JSONL file of chat examples: each line `{"messages": [...], "tools": [...]?, "enable_thinking": ?}`
    or `{"prompt": str, "answer": str}`. Raises ValueError naming the line of a malformed record."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg}).") from None
            if not isinstance(record, dict) or not ("messages" in record or {"prompt", "answer"} <= record.keys()):
                raise ValueError(
                    f"{path}:{line_number}: expected an object with 'messages' (a chat ending with the assistant "
                    "reply) or with 'prompt' and 'answer'."
                )
            if "messages" in record:
                messages = record["messages"]
                if not messages or messages[-1].get("role") != "assistant":
                    raise ValueError(f"{path}:{line_number}: the last message must be the assistant reply to learn.")
                last = messages[-1]
                if not (last.get("content") or last.get("tool_calls") or last.get("reasoning_content")):
                    raise ValueError(f"{path}:{line_number}: the assistant reply is empty.")
            elif not str(record["answer"]).strip():
                raise ValueError(f"{path}:{line_number}: the answer is empty.")
            record["_line"] = line_number
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no examples.")
    return records


def encode_chat_example(tokenizer, record: dict, max_length: int) -> dict[str, list[int]]:
    """(prompt_ids, answer_ids) of a chat record, the one encoding training and evaluation share: the prompt is
    the conversation before the last assistant turn with the generation prompt (what `generate` is given); the
    answer is the rest of the rendered conversation through its `<|im_end|>` (the reply `{% generation %}` marks).
    Both come from one tokenization of the whole conversation, so the answer is exactly what follows the prompt's
    tokens. A `{"prompt", "answer"}` record is plain text split where the caller split it, the answer ending with
    EOS."""
    line = record.get("_line", "?")
    if "messages" in record:
        messages, tools = record["messages"], record.get("tools")
        thinking = record.get("enable_thinking", True)
        prompt_text = tokenizer.apply_chat_template(
            messages[:-1], tools=tools, add_generation_prompt=True, enable_thinking=thinking, tokenize=False
        )
        full_text = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise ValueError(f"line {line}: the chat template renders the prompt differently inside the conversation.")
        full_text = full_text.rstrip("\n")  # the reply ends at its <|im_end|>, not at the newline after it
    else:  # plain text: the caller's boundary, each side tokenized on its own
        answer_text = record["answer"]
        if tokenizer.eos_token and not answer_text.endswith(tokenizer.eos_token):
            answer_text += tokenizer.eos_token
        prompt_ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        full_ids = prompt_ids + tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        return _within_context({"prompt_ids": prompt_ids, "answer_ids": full_ids[len(prompt_ids) :]}, line, max_length)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"line {line}: the prompt's tokens are not a prefix of the whole conversation's (a merge across the "
            "boundary): end the prompt on a token boundary."
        )
    return _within_context({"prompt_ids": prompt_ids, "answer_ids": full_ids[len(prompt_ids) :]}, line, max_length)


def _within_context(encoded: dict[str, list[int]], line, max_length: int) -> dict[str, list[int]]:
    length = len(encoded["prompt_ids"]) + len(encoded["answer_ids"])
    if length > max_length:
        raise ValueError(
            f"line {line}: the example has {length} tokens, more than the context of {max_length}; shorten it or "
            "raise --max-length."
        )
    return encoded


def encode_chat_examples(
    tokenizer, records: Sequence[dict], max_length: int, processes: int | None = None
) -> list[dict]:
    """`encode_chat_example` of every record, in order, over `processes` worker processes (default: one per CPU):
    rendering the chat template dominates the time of a large corpus."""
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(records) < 2000:
        return [encode_chat_example(tokenizer, record, max_length) for record in records]
    context = multiprocessing.get_context("fork")  # the workers inherit the tokenizer instead of unpickling it
    with context.Pool(processes, initializer=_set_encoding, initargs=(tokenizer, max_length)) as pool:
        return pool.map(_encode_in_worker, records, chunksize=500)


_ENCODING: tuple = ()


def _set_encoding(tokenizer, max_length: int) -> None:
    global _ENCODING
    _ENCODING = (tokenizer, max_length)


def _encode_in_worker(record: dict) -> dict:
    tokenizer, max_length = _ENCODING
    return encode_chat_example(tokenizer, record, max_length)


__all__ = [
    "LORA_EXPERT_PARAMETERS",
    "LORA_MODULES",
    "CausalChatCollator",
    "CloverDataCollator",
    "CloverTrainer",
    "ExampleNoiseEpoch",
    "clover_lora_config",
    "encode_chat_example",
    "encode_chat_examples",
    "decoding_state_noise",
    "number_examples",
    "read_chat_jsonl",
    "supervised_weight",
    "token_budget_batches",
    "unpack_batch",
]
