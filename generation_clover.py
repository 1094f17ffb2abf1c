"""Block-diffusion `generate` for Clover: LowConfidence decoding over 32-token blocks with a committed cache.

Per block (docs/DESIGN.md §6): open `block_size` mask tokens; repeat {forward the block on the committed
cache, pick a candidate and its probability at every position, commit every masked position whose probability
reaches the threshold, and at least the most confident one} until no mask is left; then commit the block to the
cache. The commit is folded into the next block's first denoising forward, so a block costs its denoising steps.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import ModelOutput, logging

from .cache_clover import CloverCache
from .configuration_clover import check_token_ids

# The decode loops, by `CloverGenerationConfig.strategy`.
STRATEGIES = {"low_confidence": "_decode_low_confidence", "self_speculative": "_decode_self_speculative"}

# A compiled generate rounds its static cache up to a multiple of this, so prompts of nearby lengths share a trace.
STATIC_LENGTH_MULTIPLE = 256

# `positions_to_keep` of a forward whose outputs nothing reads (it only fills the cache).
_NOTHING = torch.empty(0, dtype=torch.long)

logger = logging.get_logger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Configuration and output
# --------------------------------------------------------------------------------------------------------------------


class CloverGenerationConfig(GenerationConfig):
    """A `GenerationConfig` with the knobs of block diffusion. Loads from and saves to generation_config.json.

    Args:
        threshold (`float`, defaults to 0.95):
            A masked position is committed once its candidate's probability reaches it; in (0, 1]. 1.0 commits one
            token per forward (the most confident), lower values commit several per forward.
        block_size (`int`, *optional*):
            Tokens per block; defaults to, and must equal, the model's `config.block_size`.
        max_steps_per_block (`int`, *optional*):
            A cap on denoising forwards per block: with `s` steps left and `m` masks, at least `ceil(m / s)` tokens are
            committed per step.
        mask_token_id (`int`, *optional*): defaults to the model's `config.mask_token_id`.
        fuse_commit (`bool`, defaults to True):
            Commit each finished block inside the next block's first denoising forward instead of a forward of its own.
        prefill_chunk_size (`int`, defaults to 4096):
            The prompt enters the cache in chunks of this many tokens, so a long prompt never builds a dense
            (prompt x prompt) attention mask (16 GiB at 131,072 tokens).
        sparse_lm_head (`bool`, defaults to True):
            Run the last layer and project `lm_head` only on the positions still to be decided (the same tokens as
            the whole block, greedy; sampling draws fewer random numbers). Eager only: a compiled step runs the whole
            block.
        strategy (`str`, defaults to `"low_confidence"`):
            `"low_confidence"`: block diffusion, block by block. `"self_speculative"`: drafts made by block diffusion
            and verified by the causal forward, exactly the model's causal greedy decoding (greedy only, eager only;
            each row decoded on its own). The verify forward also runs the first denoising step of the next draft,
            kept when the whole draft is accepted. `max_steps_per_block` then caps the steps of a draft: fewer
            forwards per draft, fewer of its tokens accepted, the same output.
        compile (`bool`, defaults to False):
            Decode on a static cache (allocated once for the whole generation, its length rounded up to a multiple
            of 256) through a `torch.compile`d step that is traced once per input length and replayed for every
            denoising step and block. The first call pays the compilation; later calls reuse it.
    """

    def __init__(self, **kwargs):
        ours = {
            "threshold": kwargs.pop("threshold", 0.95),
            "block_size": kwargs.pop("block_size", None),
            "max_steps_per_block": kwargs.pop("max_steps_per_block", None),
            "mask_token_id": kwargs.pop("mask_token_id", None),
            "fuse_commit": kwargs.pop("fuse_commit", True),
            "compile": kwargs.pop("compile", False),
            "sparse_lm_head": kwargs.pop("sparse_lm_head", True),
            "strategy": kwargs.pop("strategy", "low_confidence"),
            # GenerationConfig knows this name too (None there means "no chunking"); here it defaults to 4096.
            "prefill_chunk_size": kwargs.pop("prefill_chunk_size", None) or 4096,
        }
        super().__init__(**kwargs)
        for name, value in ours.items():  # after the base class, which resets the names it knows
            setattr(self, name, value)
        if self.do_sample is None:  # greedy unless told, written out so pipelines see it as set and don't sample
            self.do_sample = False
        self.validate_clover()

    def validate_clover(self) -> None:
        if not isinstance(self.threshold, (int, float)) or not 0 < self.threshold <= 1:
            raise ValueError(
                f"threshold ({self.threshold!r}) must be in (0, 1]: 0.95 is the default, 1.0 decodes one token per step."
            )
        if self.max_steps_per_block is not None and (
            not isinstance(self.max_steps_per_block, int) or self.max_steps_per_block < 1
        ):
            raise ValueError(f"max_steps_per_block ({self.max_steps_per_block!r}) must be a positive integer or None.")
        if not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 1:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size!r}) must be a positive integer, e.g. 4096."
            )
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size ({self.block_size!r}) must be a positive integer or None.")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy ({self.strategy!r}) must be one of {sorted(STRATEGIES)}.")
        if self.strategy == "self_speculative" and (self.do_sample or self.compile):
            raise ValueError(
                "strategy='self_speculative' reproduces greedy causal decoding: it takes do_sample=False and "
                "compile=False."
            )

    @classmethod
    def from_model_config(cls, model_config) -> CloverGenerationConfig:
        """The stock method rebuilds the config field by field and trips on the fields above; start from its result."""
        base = GenerationConfig.from_model_config(model_config).to_dict()
        # Saved, `_from_model_config` makes the stock loader drop every field it does not know (threshold, ...).
        for key in ("transformers_version", "_from_model_config"):
            base.pop(key, None)
        return cls(
            **base,
            block_size=getattr(model_config, "block_size", None),
            mask_token_id=getattr(model_config, "mask_token_id", None),
        )


@dataclass
class CloverGenerationOutput(ModelOutput):
    """
    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_len + new_len)`):
            The (left-padded) prompt followed by the new tokens: `max_new_tokens` of them, or fewer when every row
            ended (through the last row's EOS), as autoregressive `generate` returns them; pad after a row's EOS.
        num_forward_passes (`torch.LongTensor` of shape `(batch,)`):
            Model forwards after the prompt prefill while the row was still decoding (denoising steps and any
            separate commit forwards).
        num_new_tokens (`torch.LongTensor` of shape `(batch,)`): new tokens up to and including EOS.
        tokens_per_forward (`torch.FloatTensor` of shape `(batch,)`): `num_new_tokens / num_forward_passes`.
        steps_per_block (`list[int]`): denoising forwards each block took (the batch decodes blocks together).
    """

    sequences: torch.LongTensor | None = None
    num_forward_passes: torch.LongTensor | None = None
    num_new_tokens: torch.LongTensor | None = None
    tokens_per_forward: torch.FloatTensor | None = None
    steps_per_block: list[int] | None = None


# --------------------------------------------------------------------------------------------------------------------
# Pure tensor helpers
# --------------------------------------------------------------------------------------------------------------------


def candidates_and_confidence(
    scores: torch.Tensor, sampling_scores: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token and its confidence at each position.

    `scores` (..., vocab) are the model's scores after the logits processors that change what it believes
    (repetition penalty, the caller's processors), the mask token at -inf. The candidate is their argmax, or with
    `sampling_scores` (the same scores after temperature / top-k / top-p) a draw from those. The confidence is the
    candidate's probability under `scores`, never under the warped ones: truncation renormalises a top-k or nucleus
    to sum to 1, which would make "probability >= 0.95" true of almost every draw and commit whole blocks at once.
    Softmax in fp32: the 0.95 threshold sits where bf16 probabilities are coarse."""
    probs = torch.softmax(scores.float(), dim=-1)
    if sampling_scores is None:
        candidate = probs.argmax(dim=-1)
    else:
        sampling_probs = torch.softmax(sampling_scores.float(), dim=-1).reshape(-1, probs.shape[-1])
        candidate = torch.multinomial(sampling_probs, 1, generator=generator).reshape(probs.shape[:-1])
    confidence = probs.gather(-1, candidate.unsqueeze(-1)).squeeze(-1)
    return candidate, confidence


def select_positions_to_commit(
    confidence: torch.Tensor, is_masked: torch.Tensor, threshold: float, min_to_commit: torch.Tensor | int = 1
) -> torch.Tensor:
    """The LowConfidence rule: every masked position with confidence >= threshold, and at least the
    `min_to_commit` most confident masked ones (per row). confidence/is_masked (batch, block); returns bool."""
    confidence = confidence.masked_fill(~is_masked, -1.0)  # never pick a committed position
    # threshold 1.0 means "one token per forward": an fp32 softmax can round a sure token to exactly 1.0, which
    # must not let several through.
    above = is_masked & (confidence >= threshold) if threshold < 1.0 else torch.zeros_like(is_masked)
    order = confidence.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))  # fmt: skip
    if isinstance(min_to_commit, torch.Tensor):
        min_to_commit = min_to_commit.unsqueeze(-1)
    return above | (is_masked & (rank < min_to_commit))


def min_commits_per_step(is_masked: torch.Tensor, steps_left: int | None) -> torch.Tensor | int:
    """With a step cap, commit at least ceil(masked / steps_left) per step so the block finishes in time."""
    if steps_left is None:
        return 1
    return torch.div(is_masked.sum(-1) + steps_left - 1, steps_left, rounding_mode="floor").clamp(min=1)


# --------------------------------------------------------------------------------------------------------------------
# The mixin
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class CloverDecodingState:
    """What every decoding forward of one `generate` call reads (see `CloverForBlockDiffusion.decode_step`).

    Args:
        cache: the committed cache (docs/DESIGN.md §5).
        attention_mask (`torch.LongTensor` of shape `(batch, prompt_len + capacity)`): the prompt's padding, then ones
            for every generated column (a static cache: zeros past them, to the whole buffer).
        next_position (`torch.LongTensor` of shape `(batch, 1)`): the position of each row's first generated token
            (real prompt tokens counted, so a left-padded row decodes as it would alone).
        prompt_length: columns of the (left-padded) prompt.
        padded: whether any prompt is left-padded.
        forward: the decoder's forward (`CloverModel`), or its `torch.compile`d version (`compile=True`).
    """

    cache: CloverCache
    attention_mask: torch.Tensor
    next_position: torch.Tensor
    prompt_length: int
    padded: bool
    forward: Callable[..., Any]


@dataclass
class _Decoding:
    """The per-call settings the block loop reads."""

    config: CloverGenerationConfig
    processors: LogitsProcessorList  # what the model believes: repetition penalty, the caller's processors
    warpers: LogitsProcessorList | None  # how a sample is drawn (temperature, top-k, top-p); None when greedy
    eos_ids: torch.Tensor
    pad_id: int
    max_new_tokens: int
    generator: torch.Generator | None
    streamer: Any


class CloverGenerationMixin(GenerationMixin):
    """Replaces autoregressive `generate` by block diffusion; everything else of `GenerationMixin` stays."""

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: CloverGenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: Any = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.LongTensor | CloverGenerationOutput:
        """Decodes `max_new_tokens` after each prompt by block diffusion (docs/DESIGN.md §6).

        1. Prepare: merge the generation config with the call's arguments, validate the prompt, prefill the cache.
        2. For each block:
           a. open a canvas of `block_size` masks;
           b. denoise: forward the canvas (the first forward also commits the previous block), commit the confident
              positions, until no mask is left (after a committed EOS nothing more is needed);
           c. commit: the block becomes the pending input of the next forward; EOS, stopping criteria, streamer.
        3. Finish: pad after EOS, cut to `max_new_tokens`, count forwards.

        Args:
            inputs (`torch.LongTensor` of shape `(batch, prompt_len)`): prompt ids (or pass `input_ids=`); left-pad
                batches and pass `attention_mask`.
            generation_config: a `CloverGenerationConfig`; the call's keyword arguments override its fields.
            logits_processor / stopping_criteria: extra processors (applied to each position's scores, with the
                committed sequence as `input_ids`) and criteria (checked after each block).
            streamer: receives the prompt, then each committed block (`put`); a streamer with `put_draft` also
                receives every intermediate canvas.
            generator: a `torch.Generator` for sampling (else torch's global one, so `torch.manual_seed` works).
        Returns:
            `torch.LongTensor` (batch, prompt_len + max_new_tokens, or fewer once every row has ended), or
            `CloverGenerationOutput` with `return_dict_in_generate=True`.
        """
        # 1. prepare
        config, model_kwargs = self._prepare_clover_config(generation_config, kwargs)
        input_ids, attention_mask = self._prepare_prompt(inputs, model_kwargs, config)
        max_new_tokens = self._prepare_max_new_tokens(config, input_ids.shape[1])
        eos_ids = _as_id_tensor(config.eos_token_id, input_ids.device)
        pad_id = config.pad_token_id if config.pad_token_id is not None else int(eos_ids[0]) if eos_ids.numel() else 0
        decoding = _Decoding(
            config, self._prepare_clover_processors(config, logits_processor), self._prepare_clover_warpers(config),
            eos_ids, pad_id, max_new_tokens, generator, streamer,
        )  # fmt: skip
        stopping_criteria = stopping_criteria or StoppingCriteriaList()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # 2. decode (the strategy's loop), 3. finish
        decode = getattr(self, STRATEGIES[config.strategy])
        sequences, num_forwards, steps_per_block = decode(input_ids, attention_mask, decoding, stopping_criteria)
        return self._finalize(input_ids, sequences, num_forwards, steps_per_block, decoding)

    def _decode_low_confidence(self, input_ids, attention_mask, decoding: _Decoding, stopping_criteria):
        """Block by block (docs/DESIGN.md §6): returns the prompt + decoded blocks, forwards per row, steps per block."""
        config, eos_ids, max_new_tokens = decoding.config, decoding.eos_ids, decoding.max_new_tokens
        state = self._prefill(input_ids, attention_mask, max_new_tokens, config)
        batch_size = input_ids.shape[0]
        sequences = input_ids
        finished = torch.zeros(batch_size, dtype=torch.bool, device=input_ids.device)
        num_forwards = torch.zeros(batch_size, dtype=torch.long, device=input_ids.device)
        steps_per_block: list[int] = []
        pending = None  # the last finished block, not yet in the cache
        num_blocks = math.ceil(max_new_tokens / config.block_size)
        for block in range(num_blocks):
            # 2.a open and 2.b denoise
            canvas, steps, forwards = self._decode_block(state, pending, sequences, finished, decoding)
            num_forwards += forwards
            steps_per_block.append(steps)
            # 2.c commit
            canvas = _pad_after_eos(canvas, finished, eos_ids, decoding.pad_id)
            sequences = torch.cat([sequences, canvas], dim=1)
            row_done = finished | torch.isin(canvas, eos_ids).any(dim=-1)
            if len(stopping_criteria):
                row_done = row_done | stopping_criteria(sequences[:, : input_ids.shape[1] + max_new_tokens], None)
            if decoding.streamer is not None:  # the reader sees the block up to the budget, through EOS
                budget_left = max_new_tokens - block * config.block_size
                decoding.streamer.put(_visible_tokens(canvas[0], eos_ids, budget_left).cpu())
            finished = row_done
            if bool(finished.all()) or block == num_blocks - 1:
                break
            if config.fuse_commit:
                pending = canvas  # committed by the next block's first forward
            else:
                keep = None if config.compile else _NOTHING.to(canvas.device)  # only the cache reads this forward
                self.decode_step(canvas, state=state, commit_length=canvas.shape[1], positions_to_keep=keep)
                num_forwards += (~finished).long()
        return sequences, num_forwards, steps_per_block

    def _decode_block(self, state, pending, sequences, finished, decoding: _Decoding):
        """2.a + 2.b: opens a canvas of masks (pad for finished rows) and denoises it until nothing needed is
        masked. Returns the canvas, the number of steps and the forwards each row paid."""
        config = decoding.config
        batch_size, block_size = sequences.shape[0], config.block_size
        canvas = torch.full((batch_size, block_size), config.mask_token_id, dtype=torch.long, device=sequences.device)
        # Every block is decoded whole, also the last one (cut to max_new_tokens at the end), so a shorter budget
        # yields a prefix of a longer one.
        canvas = torch.where(finished[:, None], torch.full_like(canvas, decoding.pad_id), canvas)
        to_decode = (~finished)[:, None].expand(-1, block_size)
        forwards = torch.zeros(batch_size, dtype=torch.long, device=sequences.device)
        steps = 0
        while bool(to_decode.any()):  # one host sync per step: the loop must know when the block is done
            keep = _columns_to_keep(to_decode, config)
            if pending is None:
                hidden_states = self._canvas_states(canvas, state, keep)
            else:  # the previous block enters the cache in this block's first forward
                inputs = torch.cat([pending, canvas], dim=1)
                hidden_states = self._canvas_states(inputs, state, keep, commit_length=block_size)
                pending = None
            forwards += to_decode.any(dim=-1).long()  # rows already done in this block ride along free
            steps_left = None if config.max_steps_per_block is None else max(config.max_steps_per_block - steps, 1)
            # Only logits processors read the sequence; don't copy it every step for nothing.
            context = torch.cat([sequences, canvas], dim=1) if len(decoding.processors) else None
            canvas, committed = self._denoising_step(canvas, hidden_states, to_decode, context, decoding, steps_left)
            to_decode = _stop_after_eos(canvas, to_decode & ~committed, decoding.eos_ids)
            steps += 1
            if decoding.streamer is not None and hasattr(decoding.streamer, "put_draft"):
                decoding.streamer.put_draft(canvas.cpu())
        return canvas, steps, forwards

    def decode_step(
        self,
        input_ids: torch.LongTensor,
        *,
        state: CloverDecodingState,
        commit_length: int = 0,
        causal_tokens: int = 0,
        positions_to_keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward on the committed cache (docs/DESIGN.md §5-6), eager or compiled: every decoding forward and
        the prefill's prompt chunks run through here, the one place that builds a forward's positions and mask.

        `input_ids` (batch, n) are the tokens right after the cache: a prompt chunk (all causal, all committed), one
        block to denoise (or, with `commit_length = n`, to commit), or a finished block followed by the next block's
        canvas, the first `commit_length` tokens entering the cache in the same forward. The first `causal_tokens`
        tokens are causal context (prompt chunks, the causal forward of self-speculative decoding), the rest form
        blocks of `block_size`. In an unpadded batch a forward of whole blocks attends with no mask at all (a block
        sees the cache and itself; a finished block followed by a canvas runs as two unmasked attentions); an
        all-causal forward is the causal model's. Returns the final hidden states (batch, n, hidden), for `lm_head`
        to project where a token is still to be decided; the cache advances by `commit_length`. With
        `positions_to_keep` (1-D, columns of `input_ids`) only those columns' states: the last layer runs only there.
        """
        cache, block_size = state.cache, self.config.block_size
        num_tokens = input_ids.shape[1]
        columns = torch.arange(num_tokens, device=input_ids.device)
        # Positions count each row's real tokens: a left-padded row decodes as it would alone (its pads, masked,
        # get positions below 0 that nothing reads).
        offset = cache.length - state.prompt_length  # generated tokens already committed (a 0-d tensor when static)
        position_ids = state.next_position + offset + columns
        attention_mask = state.attention_mask if cache.static else state.attention_mask[:, : cache.length + num_tokens]
        if causal_tokens == num_tokens:
            block_ids = None  # a prompt chunk: the causal forward
            attention_mask = attention_mask if state.padded or cache.static else None
        elif causal_tokens == 0 and not cache.static and not state.padded:
            attention_mask, block_ids = None, 0  # whole blocks, no padding: attention needs no mask
        else:
            block_ids = torch.where(columns < causal_tokens, -1, (columns - causal_tokens) // block_size)
            block_ids = block_ids.expand_as(input_ids)
        outputs = state.forward(
            # Embedded here: ids the model wrote itself need no range check (a host sync per forward); the prompt's
            # were checked by _prepare_prompt.
            inputs_embeds=self.model.embed_tokens(input_ids),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            block_ids=block_ids,
            commit_length=commit_length,
            use_cache=True,
            positions_to_keep=positions_to_keep,
        )
        return outputs.last_hidden_state

    def _canvas_states(self, inputs, state, keep, commit_length: int = 0) -> torch.Tensor:
        """The final hidden states (batch, block, hidden) of the canvas: the last `block_size` columns of `inputs`,
        after the `commit_length` tokens the forward commits. With `keep` (canvas columns) the last layer runs only
        there and the other columns' states are left zero: nothing reads them."""
        offset = inputs.shape[1] - self.config.block_size
        if keep is None:
            return self.decode_step(inputs, state=state, commit_length=commit_length)[:, offset:]
        kept = self.decode_step(inputs, state=state, commit_length=commit_length, positions_to_keep=keep + offset)
        return kept.new_zeros(kept.shape[0], self.config.block_size, kept.shape[2]).index_copy_(1, keep, kept)

    def _denoising_step(self, canvas, hidden_states, to_decode, context, decoding: _Decoding, steps_left):
        """One LowConfidence step on the canvas (batch, block) and its final hidden states (batch, block, hidden).
        Returns the new canvas and the positions committed in this step."""
        config = decoding.config
        # lm_head only where a token is still to be decided (at Clover's 248,320-token vocabulary the full block
        # costs up to 16 GFLOP a step); the nonzero is a host sync, as the loop's own done-check is.
        projected = to_decode if config.sparse_lm_head else torch.ones_like(to_decode)
        rows, columns = projected.nonzero(as_tuple=True)
        scores = self.lm_head(hidden_states[rows, columns]).float()  # (projected positions, vocab)
        scores[:, config.mask_token_id] = -math.inf  # never propose the mask itself
        context = context[rows] if context is not None else None  # each position sees its row's sequence
        if len(decoding.processors):
            scores = decoding.processors(context, scores)
        # Sampled from the warped scores, confident by the model's own (see candidates_and_confidence).
        sampling_scores = decoding.warpers(context, scores) if decoding.warpers is not None else None
        candidate_at, confidence_at = candidates_and_confidence(scores, sampling_scores, decoding.generator)
        candidate = canvas.index_put((rows, columns), candidate_at)
        confidence = torch.zeros(canvas.shape, device=canvas.device).index_put((rows, columns), confidence_at)
        commit = select_positions_to_commit(
            confidence, to_decode, config.threshold, min_commits_per_step(to_decode, steps_left)
        )
        return torch.where(commit, candidate, canvas), commit

    def _decode_self_speculative(self, input_ids, attention_mask, decoding: _Decoding, stopping_criteria):
        """Lossless self-speculative decoding: each row on its own, its drafts made by block diffusion and checked
        by the causal forward (the autoregressive base's), so the tokens are exactly the model's causal greedy
        decoding. Returns the prompt + the new tokens, forwards per row, and the draft steps per block."""
        rows, num_forwards, steps_per_block = [], [], []
        for row in range(input_ids.shape[0]):
            prompt = input_ids[row : row + 1, attention_mask[row].bool()]  # the row alone, unpadded
            new_tokens, forwards, steps = self._self_speculative_row(prompt, decoding, stopping_criteria)
            rows.append(new_tokens)
            num_forwards.append(forwards)
            steps_per_block += steps
        longest = max(len(tokens) for tokens in rows)
        new = torch.full((len(rows), longest), decoding.pad_id, dtype=torch.long, device=input_ids.device)
        for row, tokens in enumerate(rows):
            new[row, : len(tokens)] = tokens
        num_forwards = torch.tensor(num_forwards, dtype=torch.long, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1), num_forwards, steps_per_block

    def _self_speculative_row(self, prompt, decoding: _Decoding, stopping_criteria):
        """One row: draft a block, verify it with one causal forward, keep the longest prefix that equals the causal
        argmax plus the causal model's own next token. Returns the new tokens (through EOS, at most max_new_tokens),
        forwards, draft steps per block.

        A verify that has room for another draft after it also runs that draft's first denoising step (a block of
        masks right after the draft) and commits the draft: when the whole draft is accepted, the next draft starts
        from that step and no forward of its own commits the kept tokens. Otherwise the cache is rolled back and the
        next draft's first forward commits the kept tokens (causally) as usual. A draft that ends in EOS, or the last
        one the budget allows, is verified alone."""
        config, eos_ids, max_new_tokens = decoding.config, decoding.eos_ids, decoding.max_new_tokens
        block_size = config.block_size
        # The last prompt token is committed by the first draft's forward, which also gives the next causal token.
        # Room for the budget plus what a last iteration writes past it (its kept tokens, draft and verify).
        capacity = max_new_tokens + 2 * block_size + 1
        state = self._prefill(prompt[:, :-1], torch.ones_like(prompt[:, :-1]), capacity, config)
        pending, carried, generated, forwards, steps_per_block = prompt[:, -1:], None, [], 0, []
        length = 0
        while True:
            if carried is None:
                draft, next_token, steps = self._draft(state, pending, decoding)
                forwards += steps
            else:  # the draft's first step rode in the last verify
                next_token, canvas_states = carried
                draft, steps = self._denoise_draft(state, next_token, canvas_states, decoding)
                forwards += steps - 1
            steps_per_block.append(steps)
            carried = None
            if bool(torch.isin(next_token, eos_ids).any()):
                kept = next_token  # the causal model ends here: nothing to verify
            else:
                # Another draft follows a whole accepted one unless the budget or an EOS in the draft ends the row.
                fold = length + block_size + 1 < max_new_tokens and not bool(torch.isin(draft, eos_ids).any())
                kept, carried = self._verify(state, draft, next_token, fold, decoding)
                forwards += 1
            eos = torch.isin(kept, eos_ids).nonzero()
            if len(eos):
                kept = kept[: int(eos[0]) + 1]
            generated.append(kept)
            length += len(kept)
            sequence = torch.cat([prompt[0], *generated])[None]
            if decoding.streamer is not None:
                decoding.streamer.put(kept[: max(max_new_tokens - length + len(kept), 0)].cpu())
            done = len(eos) or length >= max_new_tokens
            if done or (len(stopping_criteria) and bool(stopping_criteria(sequence, None).all())):
                return torch.cat(generated)[:max_new_tokens], forwards, steps_per_block
            pending = kept[None]  # committed, causally, by the next draft's first forward (unless carried)

    def _verify(self, state, draft, next_token, fold: bool, decoding: _Decoding):
        """One causal forward over the draft: the longest draft prefix equal to causal greedy decoding, then the
        causal model's own next token (the correction, or after a whole accepted draft the bonus). With `fold`, the
        forward also commits the draft and runs the first denoising step of a block of masks after it; a whole
        accepted draft keeps both, the bonus then starting the next draft (returned as carried: (bonus, canvas
        states)), else the cache is rolled back. Returns (kept tokens, carried or None)."""
        block_size = draft.shape[1]
        if fold:
            snapshot = state.cache.snapshot()
            canvas = torch.full_like(draft, decoding.config.mask_token_id)
            # Read: every draft position (its causal next token), the canvas but its first column (the bonus).
            columns = torch.arange(2 * block_size, device=draft.device)
            hidden_states = self.decode_step(
                torch.cat([draft, canvas], dim=1), state=state, commit_length=block_size, causal_tokens=block_size,
                positions_to_keep=columns[columns != block_size],
            )  # fmt: skip
            canvas_states = F.pad(hidden_states[:, block_size:], (0, 0, 1, 0))  # the bonus column: never read
            hidden_states = hidden_states[:, :block_size]
        else:
            hidden_states = self.decode_step(draft, state=state, causal_tokens=block_size)
        causal_next = self.lm_head(hidden_states[0]).argmax(dim=-1)  # (block,): the causal token after draft[i]
        expected = torch.cat([next_token, causal_next[:-1]])  # causal greedy at each draft position
        mismatch = (draft[0] != expected).nonzero()
        accepted = int(mismatch[0]) if len(mismatch) else block_size  # >= 1: the draft starts with next_token
        kept = torch.cat([draft[0, :accepted], torch.cat([expected, causal_next[-1:]])[accepted : accepted + 1]])
        if not fold:
            return kept, None
        if accepted == block_size:  # the bonus is the next draft's first token, emitted with that draft
            return kept[:-1], (kept[-1:], canvas_states)
        state.cache.restore(snapshot)
        return kept, None

    def _draft(self, state, pending, decoding: _Decoding):
        """A LowConfidence draft of the next block; its first forward commits `pending` causally and gives the
        causal next token, which the draft starts with. Returns (draft (1, block), next token (1,), steps)."""
        block_size = decoding.config.block_size
        canvas = torch.full((1, block_size), decoding.config.mask_token_id, dtype=torch.long, device=pending.device)
        inputs, committed = torch.cat([pending, canvas], dim=1), pending.shape[1]
        # Read: the last pending token's state (the causal next token) and the canvas's.
        keep = torch.arange(committed - 1, inputs.shape[1], device=inputs.device)
        hidden_states = self.decode_step(inputs, state=state, commit_length=committed, causal_tokens=committed, positions_to_keep=keep)  # fmt: skip
        next_token = self.lm_head(hidden_states[:, 0]).argmax(dim=-1)  # what causal greedy emits
        draft, steps = self._denoise_draft(state, next_token, hidden_states[:, 1:], decoding)
        return draft, next_token, steps

    def _denoise_draft(self, state, next_token, hidden_states, decoding: _Decoding):
        """The rest of a draft: a canvas starting with `next_token`, its masks denoised from `hidden_states`, the
        canvas states of its first forward (already run), until none is left. Returns (draft, steps)."""
        config = decoding.config
        canvas = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.long, device=next_token.device)
        canvas[:, 0] = next_token
        to_decode, steps = canvas == config.mask_token_id, 1
        while True:
            # max_steps_per_block caps a draft's steps: a cheaper, rougher draft; the verify keeps the output exact.
            steps_left = None if config.max_steps_per_block is None else max(config.max_steps_per_block - steps + 1, 1)
            canvas, committed = self._denoising_step(canvas, hidden_states, to_decode, None, decoding, steps_left)
            to_decode = _stop_after_eos(canvas, to_decode & ~committed, decoding.eos_ids)
            if decoding.streamer is not None and hasattr(decoding.streamer, "put_draft"):
                decoding.streamer.put_draft(canvas.cpu())
            if not bool(to_decode.any()):
                return canvas, steps
            hidden_states = self._canvas_states(canvas, state, _columns_to_keep(to_decode, config))
            steps += 1

    def _finalize(self, input_ids, sequences, num_forwards, steps_per_block, decoding: _Decoding):
        """3: the prompt plus the new tokens, as autoregressive `generate` returns them: `max_new_tokens` columns,
        or fewer when every row has ended (through the last row's EOS; pad after each row's own EOS); the counts."""
        if decoding.streamer is not None:
            decoding.streamer.end()
        max_new_tokens = decoding.max_new_tokens
        new_tokens = sequences[:, input_ids.shape[1] : input_ids.shape[1] + max_new_tokens]
        num_new = torch.clamp(first_eos_index(new_tokens, decoding.eos_ids) + 1, max=new_tokens.shape[1])
        # The blocks past the last EOS hold only pad: cut, as AR decoding stops once every row is done.
        new_tokens = new_tokens[:, : int(num_new.max())]
        sequences = torch.cat([input_ids, new_tokens], dim=1)
        if not decoding.config.return_dict_in_generate:
            return sequences
        return CloverGenerationOutput(
            sequences=sequences,
            num_forward_passes=num_forwards,
            num_new_tokens=num_new,
            tokens_per_forward=num_new.float() / num_forwards.clamp(min=1).float(),
            steps_per_block=steps_per_block,
        )

    # ---- 1. preparation --------------------------------------------------------------------------------------------

    def _prepare_clover_config(self, generation_config, kwargs) -> tuple[CloverGenerationConfig, dict]:
        base = generation_config if generation_config is not None else self.generation_config
        config = CloverGenerationConfig.from_dict(base.to_dict()) if not isinstance(base, CloverGenerationConfig) else copy.deepcopy(base)  # fmt: skip
        for name in ("max_new_tokens", "max_length"):  # before GenerationConfig compares them with numbers
            value = kwargs.get(name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise TypeError(f"{name} ({value!r}) must be an int, e.g. {name}=256.")
        model_kwargs = config.update(**kwargs)
        config.validate_clover()
        if config.block_size is None:
            config.block_size = self.config.block_size
        if config.block_size != self.config.block_size:
            raise ValueError(
                f"block_size ({config.block_size}) differs from the block size this model was trained with "
                f"({self.config.block_size}); leave block_size unset or pass {self.config.block_size}."
            )
        if config.mask_token_id is None:
            config.mask_token_id = self.config.mask_token_id
        if config.eos_token_id is None:
            config.eos_token_id = self.config.eos_token_id
        if config.pad_token_id is None:
            config.pad_token_id = self.config.pad_token_id
        if config.num_beams not in (None, 1):
            raise ValueError(f"num_beams ({config.num_beams}) is not supported by block diffusion; use num_beams=1.")
        if config.num_return_sequences not in (None, 1):
            raise ValueError(
                f"num_return_sequences ({config.num_return_sequences}) is not supported; repeat the prompt instead."
            )
        return config, model_kwargs

    def _prepare_prompt(self, inputs, model_kwargs, config) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
        attention_mask = model_kwargs.pop("attention_mask", None)
        for ignored in ("use_cache", "position_ids", "token_type_ids"):
            model_kwargs.pop(ignored, None)
        if model_kwargs:
            raise ValueError(
                f"generate() got arguments it does not know: {sorted(model_kwargs)}. Clover takes the prompt "
                "(input_ids, attention_mask) and generation-config fields."
            )
        if input_ids is not None and not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.LongTensor of shape (batch, prompt_len), not a {type(input_ids).__name__}: "
                "pass tokenizer(..., return_tensors='pt') or torch.tensor([ids])."
            )
        if input_ids is None or input_ids.numel() == 0:
            raise ValueError(
                "The prompt is empty: block diffusion needs at least one prompt token; start from the chat "
                "template's generation prompt or a BOS-like token."
            )
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise TypeError(
                f"input_ids holds {input_ids.dtype} values; token ids are integers: pass input_ids.long() if they "
                "are whole numbers, or the tokenizer's output."
            )
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)}; generate takes (batch, prompt_len): flatten the "
                "extra dimensions into the batch, e.g. input_ids.reshape(-1, input_ids.shape[-1])."
            )
        embeddings = self.get_input_embeddings()
        hook = getattr(embeddings, "_hf_hook", None)  # offloaded (cpu/disk): weight on meta, run on the hook's device
        on_hook = getattr(hook, "execution_device", None)
        device = torch.device(on_hook) if on_hook is not None else embeddings.weight.device
        input_ids = input_ids.to(device)
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}."
            )
        empty_rows = (attention_mask == 0).all(dim=-1).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(
                f"Row(s) {empty_rows} of attention_mask are all zeros: those prompts have no tokens. Drop them from "
                "the batch or give each at least one token (the chat template's generation prompt)."
            )
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "A prompt ends in padding: block diffusion appends after the last column, so pad on the left "
                "(tokenizer.padding_side = 'left')."
            )
        check_token_ids(input_ids, self.config.vocab_size)  # decoding forwards embed without checking
        if bool(((input_ids == config.mask_token_id) & attention_mask.bool()).any()):
            raise ValueError(
                f"The prompt contains the mask token (id {config.mask_token_id}), which only marks positions still "
                "to decode; remove <|mask|> from the prompt text."
            )
        return input_ids, attention_mask

    def _prepare_max_new_tokens(self, config, prompt_len: int) -> int:
        max_new_tokens = config.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = (config.max_length or 20) - prompt_len
        if max_new_tokens < 1:
            raise ValueError(
                f"Nothing to generate: max_length ({config.max_length}) is not above the prompt length ({prompt_len}); "
                "set max_new_tokens."
            )
        limit = self.config.max_position_embeddings
        over = prompt_len + max_new_tokens - limit
        if over > 0:
            lower = f" or lower max_new_tokens to {limit - prompt_len}" if prompt_len < limit else ""
            raise ValueError(
                f"The prompt ({prompt_len} tokens) and max_new_tokens ({max_new_tokens}) need {prompt_len + max_new_tokens} "
                f"tokens, {over} over the context of {limit}: shorten the prompt by {over} tokens{lower}."
            )
        return max_new_tokens

    def _prepare_clover_processors(self, config, user_processors) -> LogitsProcessorList:
        """The processors that shape the model's distribution, which the threshold reads."""
        processors = LogitsProcessorList()
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
        processors.extend(user_processors or [])
        return processors

    def _prepare_clover_warpers(self, config) -> LogitsProcessorList | None:
        """The warpers a sample is drawn through (None: greedy). They change which token is drawn, never the
        confidence it is committed with: with `top_k=1` sampling decodes exactly as greedy does."""
        if not config.do_sample:
            return None
        warpers = LogitsProcessorList()
        if config.temperature is not None and config.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            warpers.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            warpers.append(TopPLogitsWarper(config.top_p))
        return warpers

    def _prefill(self, input_ids, attention_mask, max_new_tokens: int, config) -> CloverDecodingState:
        """Builds the cache (static with `compile`), enters the prompt in chunks of `prefill_chunk_size` (so a long
        prompt never builds a dense prompt x prompt mask), and returns the decoding state."""
        batch_size, prompt_length = input_ids.shape
        capacity = math.ceil(max_new_tokens / config.block_size) * config.block_size
        # One block more than is ever committed: a fused forward writes the next canvas past the committed length.
        max_length = prompt_length + capacity + config.block_size
        if config.compile:  # few distinct buffer lengths, so the compiled step is not retraced for every prompt length
            max_length = -(-max_length // STATIC_LENGTH_MULTIPLE) * STATIC_LENGTH_MULTIPLE
        cache = CloverCache(self.config, max_length=max_length, static=config.compile, device=input_ids.device)
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(batch_size, capacity)], dim=1)
        if config.compile:  # padded once to the buffer: every step of every prompt in the bucket has one mask shape
            full_mask = torch.nn.functional.pad(full_mask, (0, max_length - full_mask.shape[1]))
        state = CloverDecodingState(
            cache=cache,
            attention_mask=full_mask,
            next_position=attention_mask.sum(-1, keepdim=True),
            prompt_length=prompt_length,
            padded=not bool(attention_mask.all()),
            forward=self.model,  # the prompt runs eager: a compiled step is traced for the decoding shapes only
        )
        for start in range(0, prompt_length, config.prefill_chunk_size):
            chunk = input_ids[:, start : start + config.prefill_chunk_size]
            # Only the cache reads a prompt chunk: no output column is kept.
            self.decode_step(chunk, state=state, commit_length=chunk.shape[1], causal_tokens=chunk.shape[1], positions_to_keep=_NOTHING.to(chunk.device))  # fmt: skip
        if config.compile:
            state.forward = self._compiled_forward()
        return state

    def _compiled_forward(self):
        """The decoder's forward, compiled once per model (traced once per input length on a static cache)."""
        if getattr(self, "_clover_compiled_forward", None) is None:
            # Compile a bound method, not a module: a module attribute would join the state dict.
            self._clover_compiled_forward = torch.compile(self.model.forward)
        return self._clover_compiled_forward

    def _prepare_generation_config(self, generation_config=None, **kwargs):
        """Pipelines on transformers 5.2 build their config here, with their defaults (do_sample=True,
        temperature=0.7) winning over the model's. Priority here: the call's kwargs, then the model's generation
        config, then `generation_config` only where the model leaves a field unset."""
        config = CloverGenerationConfig.from_dict(self.generation_config.to_dict())
        if generation_config is not None:
            defaults = generation_config.to_diff_dict()
            config.update(**{key: value for key, value in defaults.items() if getattr(config, key, None) is None})
        model_kwargs = config.update(**kwargs)
        return config, model_kwargs

    # ---- loading -------------------------------------------------------------------------------------------------

    @staticmethod
    def _default_generation_config(model_config) -> CloverGenerationConfig:
        """The generation config a new model starts with (the model's `__init__` sets it; transformers' own is a
        plain `GenerationConfig`): the defaults of `CloverGenerationConfig` with the model's block size and mask."""
        return CloverGenerationConfig.from_model_config(model_config)

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs):  # fmt: skip
        """The stock loader reads generation_config.json into a plain GenerationConfig (which can drop our fields);
        read it as a CloverGenerationConfig instead."""
        super().adjust_generation_fn(generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs)  # fmt: skip
        if generation_config is None and pretrained_model_name_or_path is not None:
            try:
                self.generation_config = CloverGenerationConfig.from_pretrained(
                    pretrained_model_name_or_path, subfolder=kwargs.get("subfolder") or ""
                )
                return
            except OSError:
                pass
        if not isinstance(self.generation_config, CloverGenerationConfig):
            self.generation_config = CloverGenerationConfig.from_dict(self.generation_config.to_dict())


def _as_id_tensor(token_ids, device) -> torch.Tensor:
    if token_ids is None:
        return torch.empty(0, dtype=torch.long, device=device)
    if isinstance(token_ids, int):
        token_ids = [token_ids]
    return torch.tensor(list(token_ids), dtype=torch.long, device=device)


def first_eos_index(tokens: torch.Tensor, eos_ids: torch.Tensor, is_eos: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of `tokens` (batch, n), the index of its first EOS, or n when it has none. `is_eos` overrides which
    positions count as EOS."""
    if is_eos is None:
        is_eos = torch.isin(tokens, eos_ids)
    index = torch.arange(tokens.shape[-1], device=tokens.device)
    return torch.where(is_eos, index, tokens.shape[-1]).min(dim=-1).values


def _columns_to_keep(to_decode, config) -> torch.Tensor | None:
    """The canvas columns a denoising forward must run its last layer on: where some row still decides a token
    (`sparse_lm_head`). None (every column) when compiled: a varying length would retrace the step."""
    if config.compile or not config.sparse_lm_head:
        return None
    return to_decode.any(dim=0).nonzero().squeeze(1)


def _stop_after_eos(canvas, to_decode, eos_ids) -> torch.Tensor:
    """A row whose first EOS is committed with nothing masked before it is done: what follows becomes pad, so
    decoding it would only cost forwards."""
    if eos_ids.numel() == 0:
        return to_decode
    first_eos = first_eos_index(canvas, eos_ids, torch.isin(canvas, eos_ids) & ~to_decode)[:, None]
    index = torch.arange(canvas.shape[1], device=canvas.device)
    masked_before = (to_decode & (index < first_eos)).any(dim=-1, keepdim=True)
    return to_decode & ~((index > first_eos) & ~masked_before)


def _pad_after_eos(canvas, finished, eos_ids, pad_id) -> torch.Tensor:
    index = torch.arange(canvas.shape[1], device=canvas.device)
    after_eos = index > first_eos_index(canvas, eos_ids)[:, None]
    return torch.where(after_eos | finished[:, None], torch.full_like(canvas, pad_id), canvas)


def _visible_tokens(row: torch.Tensor, eos_ids, budget_left: int) -> torch.Tensor:
    """The tokens of a committed block a reader should see: within the budget, through the first EOS."""
    row = row[:budget_left]
    return row[: int(first_eos_index(row, eos_ids)) + 1]


__all__ = [
    "CloverDecodingState",
    "CloverGenerationConfig",
    "CloverGenerationMixin",
    "CloverGenerationOutput",
    "candidates_and_confidence",
    "select_positions_to_commit",
]
