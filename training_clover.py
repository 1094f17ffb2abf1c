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

import functools
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

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
        draw = functools.partial(draw_training_noise, suffix_prob=self.suffix_prob)
        if self.per_example_noise:
            generators = [self.example_generator(f["example_index"]) for f in features]
            lengths = [len(answer) for _, answer in examples]
            noise_mask, noise_level = example_block_noise(layout, lengths, bs, generators, self.eps, draw)
        else:
            noise_mask, noise_level = draw(labels != -100, block_ids, bs, self.next_generator(), self.eps)
        noise_mask |= tail_mask
        batch_out = layout | {"noise_mask": noise_mask, "noise_level": noise_level}
        if self.complementary:
            complement = ((labels != -100) & ~noise_mask) | tail_mask
            complement_level = torch.where(block_ids >= 0, (1 - noise_level).clamp(min=self.eps), noise_level)
            batch_out = {key: torch.cat([value, value]) for key, value in batch_out.items()}
            batch_out["noise_mask"] = torch.cat([noise_mask, complement])
            batch_out["noise_level"] = torch.cat([noise_level, complement_level])
        return batch_out


def draw_training_noise(
    supervised: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
    suffix_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_block_noise`, and with `suffix_prob > 0` that share of the blocks masked as a suffix instead: the last
    ceil(t * n) of the block's n supervised tokens, the clean prefix before them. Those are the states
    left-to-right-ish decoding meets (LowConfidence commits mostly from the left), on which the uniform draw rarely
    lands for long answers. With `suffix_prob=0` the draws are exactly those of the uniform noise alone."""
    mask, level = draw_block_noise(supervised, block_ids, block_size, generator, eps)
    if suffix_prob == 0:
        return mask, level
    batch_size, num_blocks = block_ids.shape[0], max(int(block_ids.max()) + 1, 1)
    in_block, index = block_ids >= 0, block_ids.clamp(min=0)
    # Each block's t, read back from the levels (outside the blocks the level is 1, never below a block's t).
    t = torch.ones(batch_size, num_blocks, device=level.device).scatter_reduce(1, index, level, reduce="amin")
    as_suffix = torch.rand(batch_size, num_blocks, generator=generator, device="cpu").to(level.device) < suffix_prob
    scored = supervised & in_block
    per_block = torch.zeros_like(t, dtype=torch.long).scatter_add_(1, index, scored.long())
    # 1-based rank of each supervised token in its block (blocks are contiguous and in order along a row)
    rank = scored.long().cumsum(1) - (per_block.cumsum(1) - per_block).gather(1, index)
    kept = per_block - (t * per_block).ceil().long()  # the clean prefix: the first n - ceil(t * n) tokens
    suffix = scored & (rank > kept.gather(1, index))
    return torch.where(as_suffix.gather(1, index) & in_block, suffix, mask), level


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


__all__ = [
    "CloverDataCollator",
    "ExampleNoiseEpoch",
    "draw_training_noise",
    "number_examples",
    "token_budget_batches",
    "unpack_batch",
]
