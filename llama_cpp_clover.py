"""Clover's decoding on llama.cpp's kernels: block diffusion (LowConfidence) and self-speculative decoding over a
GGUF file written by `gguf_clover`, through llama-cpp-python's low-level API.

The decoding rule is generation_clover's (docs/DESIGN.md §6), with its helpers; only the forwards run on llama.cpp:

* The committed tokens (prompt, finished blocks) live in llama.cpp's memory, sequence `main`: attention K/V and the
  Gated DeltaNet states. llama.cpp cannot crop a Gated DeltaNet state, and every decode writes the memory, so a
  denoising step runs on a scratch sequence: `llama_memory_seq_cp(main -> scratch)` (the K/V cells are shared, the
  recurrent state is copied inside the graph), the canvas decoded there, the scratch dropped.
* A block's tokens see each other: denoising and committing decode with `llama_set_causal_attn(ctx, False)`. A
  llama.cpp mask is causal or all-visible within a sequence, so the finished block cannot be committed in the
  next block's first forward (the fused commit of generation_clover: the finished block would see the new canvas);
  each block after the first costs one commit forward, counted in `num_forward_passes`.
* Self-speculative: the draft's causal prefix and verification run with causal attention; a verify runs on the
  scratch sequence, which becomes `main` when the whole draft is accepted (nothing to redo).

One sequence at a time. Logits are requested only at the positions still to decide.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .generation_clover import (
    candidates_and_confidence,
    first_eos_index,
    min_commits_per_step,
    select_positions_to_commit,
)
from .gguf_clover import read_clover_metadata

STRATEGIES = ("low_confidence", "self_speculative", "autoregressive")
MAIN, SCRATCH = 0, 1


@dataclass
class LlamaCppGenerationOutput:
    """`tokens`: the new tokens (through the first EOS, at most `max_new_tokens`); `num_forward_passes`: llama.cpp
    decodes after the prompt (denoising steps, commits, causal forwards, verifies); `steps_per_block`: denoising
    forwards per block (or per draft)."""

    tokens: list[int]
    num_new_tokens: int
    num_forward_passes: int
    steps_per_block: list[int] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        return self.num_new_tokens / max(self.num_forward_passes, 1)


def _quiet_log(level, text, user_data):  # llama.cpp's log lines, muted unless verbose
    return None


_QUIET = None


class LlamaCppClover:
    """A Clover GGUF on llama.cpp: `generate` decodes as `CloverForBlockDiffusion.generate` does, one sequence.

    Args:
        path: a GGUF file from `gguf_clover.export_gguf` (any type).
        n_ctx: tokens of context (prompt and output, plus one block of room).
        n_threads: CPU threads (default: all cores).
        n_gpu_layers: layers offloaded to a GPU build of llama.cpp (0 on a CPU build).
        experts_on_cpu: keep the routed experts' weights in system memory whatever `n_gpu_layers` says (llama.cpp's
            `--cpu-moe`): the 35B in q4_k_m on a 16 GB card.
        verbose: keep llama.cpp's own log on stderr.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        experts_on_cpu: bool = False,
        verbose: bool = False,
    ):
        import llama_cpp

        self.lib = lib = llama_cpp
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such file; write a GGUF with python scripts/export_gguf.py.")
        try:
            facts = read_clover_metadata(path)
        except (ValueError, OSError) as error:
            raise ValueError(
                f"{path} is not a GGUF file ({error}); write one with python scripts/export_gguf.py."
            ) from None
        if "mask_token_id" not in facts or "block_size" not in facts:
            raise ValueError(
                f"{path} has no clover.mask_token_id / clover.block_size: it is not a Clover GGUF. Export a Clover "
                "checkpoint (a plain Qwen3.5-MoE file runs on llama.cpp as is, e.g. python -m llama_cpp.server)."
            )
        global _QUIET
        if not verbose:
            _QUIET = llama_cpp.llama_log_callback(_quiet_log)
            lib.llama_log_set(_QUIET, ctypes.c_void_p())
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        if experts_on_cpu:
            self._overrides = _experts_on_cpu()  # kept alive: llama.cpp reads it while loading
            model_params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}: is it a GGUF file (python scripts/export_gguf.py)?")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.mask_token_id, self.block_size = int(facts["mask_token_id"]), int(facts["block_size"])
        self.threshold = round(float(facts.get("threshold", 0.95)), 6)  # stored as float32
        self.eos_token_ids = [int(t) for t in facts.get("eos_token_ids", [lib.llama_vocab_eos(self.vocab)])]
        pad = self._meta_int("tokenizer.ggml.padding_token_id")
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.n_ctx = n_ctx
        context_params = lib.llama_context_default_params()
        context_params.n_ctx = n_ctx
        # Non-causal forwards must fit one micro-batch; prompts longer than this are entered in chunks.
        context_params.n_batch = context_params.n_ubatch = 512
        context_params.n_seq_max = 2  # main + scratch
        # One K/V buffer for both: a copy to the scratch sequence then only tags the cells (with a buffer per
        # sequence, llama.cpp copies the whole buffer, and each sequence gets half the context).
        context_params.kv_unified = True
        threads = n_threads or os.cpu_count() or 1
        context_params.n_threads = context_params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, context_params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}.")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(512, 0, 1)
        self._causal = None
        self._main, self._scratch = MAIN, SCRATCH

    # ---- metadata, tokenizer, chat template ------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(4096)
        length = self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if length >= 0 else None

    def _meta_int(self, key: str) -> int | None:
        value = self._meta(key)
        return int(value) if value is not None else None

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS; special tokens such as <|im_start|> parsed when `special`)."""
        data = text.encode()
        room = len(data) + 16
        tokens = (self.lib.llama_token * room)()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, room, False, special)
        return list(tokens[:count])

    def detokenize(self, tokens: Sequence[int], skip_special: bool = True) -> str:
        room = 16 * len(tokens) + 64
        buffer = ctypes.create_string_buffer(room)
        array = (self.lib.llama_token * len(tokens))(*tokens)
        count = self.lib.llama_detokenize(self.vocab, array, len(tokens), buffer, room, skip_special, False)
        return buffer.raw[: max(count, 0)].decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text of a conversation with the generation prompt, by the chat template in the GGUF file
        (rendered as transformers renders it; keyword arguments such as enable_thinking reach the template)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.lib.llama_model_chat_template(self.model, None)
        if not template:
            raise ValueError("This GGUF file carries no chat template; pass a raw prompt instead.")
        rendered = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template.decode(),
            add_generation_prompt=True,
            **kwargs,
        )
        if isinstance(rendered, tuple):  # releases returning (texts, generation indices)
            rendered = rendered[0]
        return rendered[0] if isinstance(rendered, list) else rendered

    # ---- forwards ----------------------------------------------------------------------------------------------------

    def _set_causal(self, causal: bool) -> None:
        if self._causal is not causal:
            self.lib.llama_set_causal_attn(self.ctx, causal)
            self._causal = causal

    def _decode(self, tokens: Sequence[int], start: int, seq: int, outputs: Sequence[int] = (), causal=True):
        """Decodes `tokens` at positions start.. on sequence `seq`; returns the logits (len(outputs), vocab) of the
        columns in `outputs`, float32."""
        self._set_causal(causal)
        batch, n = self.batch, len(tokens)
        if n > 512:
            raise ValueError(f"One forward takes at most 512 tokens, not {n}.")
        wanted = set(outputs)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i in wanted
        batch.n_tokens = n
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {n} tokens at position {start}.")
        if not outputs:
            return None
        logits = self.lib.llama_get_logits(self.ctx)
        rows = np.ctypeslib.as_array(logits, shape=(len(outputs), self.n_vocab))
        order = np.argsort(np.argsort(outputs))  # llama.cpp returns the output rows in column order
        return torch.from_numpy(rows[order].copy())

    def _prefill(self, prompt: Sequence[int]) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        self._main, self._scratch = MAIN, SCRATCH
        for start in range(0, len(prompt), 512):
            self._decode(prompt[start : start + 512], start, self._main)

    def _on_scratch(self, tokens, start, outputs, causal) -> torch.Tensor:
        """A forward on a copy of the committed sequence, dropped afterwards: the memory is left as it was."""
        self.lib.llama_memory_seq_cp(self.memory, self._main, self._scratch, -1, -1)
        try:
            return self._decode(tokens, start, self._scratch, outputs, causal)
        finally:
            self.lib.llama_memory_seq_rm(self.memory, self._scratch, -1, -1)

    def causal_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Causal logits (len(ids), vocab) of a sequence: the model's autoregressive forward (for checks)."""
        self.lib.llama_memory_clear(self.memory, True)
        return self._decode(list(ids), 0, MAIN, outputs=range(len(ids)), causal=True)

    def denoising_logits(self, prompt: Sequence[int], canvas: Sequence[int]) -> torch.Tensor:
        """Logits (block, vocab) of a canvas (mask tokens and committed ones) denoised on the prompt (for checks)."""
        self._prefill(list(prompt))
        return self._on_scratch(list(canvas), len(prompt), range(len(canvas)), causal=False)

    # ---- generate ----------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int = 256,
        strategy: str = "low_confidence",
        threshold: float | None = None,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        max_steps_per_block: int | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        streamer: Callable[[list[int]], None] | None = None,
    ) -> LlamaCppGenerationOutput:
        """Decodes after `prompt` (token ids) as `CloverForBlockDiffusion.generate` does (docs/DESIGN.md §6):
        `strategy` "low_confidence" (block diffusion at `threshold`, default the file's), "self_speculative" (the
        causal greedy output, drafted by block diffusion) or "autoregressive" (llama.cpp's causal greedy decoding,
        one token per forward, for comparison). Sampling: a candidate is drawn from the scores after temperature,
        top-k, top-p; its confidence is its probability under the unwarped scores. The draws are `generate`'s (one
        per undecided position, in order), so `seed` (or a `generator`) seeded as `generate`'s generator gives its
        tokens. `streamer(tokens)` receives each committed block (or accepted run)."""
        prompt = [int(t) for t in prompt]
        threshold = self.threshold if threshold is None else threshold
        self._check(prompt, max_new_tokens, strategy, threshold, do_sample)
        if strategy != "low_confidence" and repetition_penalty not in (None, 1.0):
            raise ValueError(f"strategy={strategy!r} reproduces greedy causal decoding: drop repetition_penalty.")
        if generator is None and seed is not None:
            generator = torch.Generator().manual_seed(seed)
        processors = LogitsProcessorList()
        if repetition_penalty not in (None, 1.0):
            processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        warpers = None
        if do_sample:
            warpers = LogitsProcessorList()
            if temperature not in (None, 1.0):
                warpers.append(TemperatureLogitsWarper(temperature))
            if top_k not in (None, 0):
                warpers.append(TopKLogitsWarper(top_k))
            if top_p not in (None, 1.0):
                warpers.append(TopPLogitsWarper(top_p))
        rule = _Rule(self.mask_token_id, torch.tensor(self.eos_token_ids), threshold, processors, warpers, generator)
        if strategy == "low_confidence":
            return self._low_confidence(prompt, max_new_tokens, rule, max_steps_per_block, streamer)
        if strategy == "self_speculative":
            return self._self_speculative(prompt, max_new_tokens, rule, max_steps_per_block, streamer)
        return self._autoregressive(prompt, max_new_tokens, rule, streamer)

    def _check(self, prompt, max_new_tokens, strategy, threshold, do_sample) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy ({strategy!r}) must be one of {', '.join(STRATEGIES)}.")
        if not prompt:
            raise ValueError("The prompt is empty: block diffusion needs at least one prompt token.")
        if min(prompt) < 0 or max(prompt) >= self.n_vocab:
            raise ValueError(f"The prompt has ids outside the vocabulary [0, {self.n_vocab}).")
        if self.mask_token_id in prompt:
            raise ValueError(f"The prompt contains the mask token (id {self.mask_token_id}); remove <|mask|>.")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens!r}) must be a positive int.")
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold ({threshold!r}) must be in (0, 1].")
        if strategy != "low_confidence" and do_sample:
            raise ValueError(f"strategy={strategy!r} is greedy: it takes do_sample=False.")
        room = len(prompt) + math.ceil(max_new_tokens / self.block_size) * self.block_size + self.block_size + 1
        if room > self.n_ctx:
            raise ValueError(
                f"The prompt ({len(prompt)} tokens) and max_new_tokens ({max_new_tokens}) need a context of {room}; "
                f"this one holds {self.n_ctx}: pass n_ctx={room} or more, or lower max_new_tokens."
            )

    def _denoise(self, start: int, canvas: torch.Tensor, to_decode: torch.Tensor, rule, steps_cap, context):
        """Denoises `canvas` (block,) at position `start` on the committed sequence until nothing needed is masked;
        `to_decode` says which positions to decide; `context` (the tokens before the canvas) is needed only by
        logits processors. Returns (canvas, steps)."""
        steps = 0
        while bool(to_decode.any()):
            columns = to_decode.nonzero().flatten()
            logits = self._on_scratch(canvas.tolist(), start, columns.tolist(), causal=False)
            steps_left = None if steps_cap is None else max(steps_cap - steps, 1)
            sequence = torch.cat([context, canvas]) if context is not None else None  # what processors read
            canvas, committed = rule.step(logits, canvas, to_decode, columns, steps_left, sequence)
            to_decode = rule.stop_after_eos(canvas, to_decode & ~committed)
            steps += 1
        return canvas, steps

    def _low_confidence(self, prompt, max_new_tokens, rule, steps_cap, streamer) -> LlamaCppGenerationOutput:
        block_size = self.block_size
        self._prefill(prompt)
        new, forwards, steps_per_block = [], 0, []
        for block in range(math.ceil(max_new_tokens / block_size)):
            start = len(prompt) + block * block_size
            canvas = torch.full((block_size,), self.mask_token_id)
            context = torch.tensor(prompt + new) if len(rule.processors) else None
            canvas, steps = self._denoise(start, canvas, torch.ones(block_size, dtype=torch.bool), rule, steps_cap, context)  # fmt: skip
            forwards += steps
            steps_per_block.append(steps)
            eos = int(first_eos_index(canvas[None], rule.eos_ids)[0])
            canvas[eos + 1 :] = self.pad_token_id  # what follows a committed EOS is pad
            new += canvas.tolist()
            if streamer is not None:
                streamer(canvas[: min(eos + 1, max_new_tokens - block * block_size)].tolist())
            if eos < block_size or (block + 1) * block_size >= max_new_tokens:
                break
            self._decode(canvas.tolist(), start, self._main, causal=False)  # commit the block
            forwards += 1
        return _finish(new, max_new_tokens, rule.eos_ids, forwards, steps_per_block)

    def _self_speculative(self, prompt, max_new_tokens, rule, steps_cap, streamer) -> LlamaCppGenerationOutput:
        """generation_clover's self-speculative loop: a draft by block diffusion, one causal verify, the longest
        prefix equal to causal greedy plus the causal model's own next token."""
        block_size, mask = self.block_size, self.mask_token_id
        self._prefill(prompt[:-1])
        committed = len(prompt) - 1  # tokens in the main sequence
        pending, carried = [prompt[-1]], None
        generated, forwards, steps_per_block = [], 0, []
        while True:
            if carried is None:  # commit the pending tokens causally; their last logits give the next token
                logits = self._decode(pending, committed, self._main, outputs=[len(pending) - 1], causal=True)
                committed += len(pending)
                next_token = int(logits[0].argmax())
                forwards += 1
            else:
                next_token = carried
            # The draft's first step sees a canvas of masks only (as generation_clover's, fused there with the
            # forward before it); the next token then fills its first position.
            canvas = torch.full((block_size,), mask)
            columns = list(range(1, block_size))
            logits = self._on_scratch(canvas.tolist(), committed, columns, causal=False)
            canvas[0] = next_token
            to_decode = canvas == mask
            canvas, done = rule.step(logits, canvas, to_decode, torch.tensor(columns), _cap(steps_cap, 0), None)
            to_decode = rule.stop_after_eos(canvas, to_decode & ~done)
            more = _cap(steps_cap, 1)
            canvas, steps = self._denoise(committed, canvas, to_decode, rule, more, None)
            steps += 1
            forwards += steps
            steps_per_block.append(steps)
            carried = None
            draft = canvas.tolist()
            length = sum(len(g) for g in generated)
            if next_token in self.eos_token_ids:
                kept = [next_token]
            else:
                # Verify on the scratch sequence: the draft, causally, after the committed tokens.
                self.lib.llama_memory_seq_cp(self.memory, self._main, self._scratch, -1, -1)
                logits = self._decode(draft, committed, self._scratch, range(block_size), causal=True)
                forwards += 1
                causal_next = logits.argmax(-1).tolist()
                expected = [next_token, *causal_next[:-1]]
                accepted = next((i for i in range(block_size) if draft[i] != expected[i]), block_size)
                kept = draft[:accepted] + [(expected + causal_next[-1:])[accepted]]
                fold = length + block_size + 1 < max_new_tokens and not any(t in self.eos_token_ids for t in draft)
                if accepted == block_size and fold:  # the draft is committed: the scratch becomes main
                    self.lib.llama_memory_seq_rm(self.memory, self._main, -1, -1)
                    self._main, self._scratch = self._scratch, self._main
                    committed += block_size
                    carried, kept = kept[-1], kept[:-1]
                else:
                    self.lib.llama_memory_seq_rm(self.memory, self._scratch, -1, -1)
            eos = next((i for i, t in enumerate(kept) if t in self.eos_token_ids), None)
            if eos is not None:
                kept = kept[: eos + 1]
            generated.append(kept)
            length += len(kept)
            if streamer is not None:
                streamer(kept[: max(max_new_tokens - length + len(kept), 0)])
            if eos is not None or length >= max_new_tokens:
                tokens = [t for g in generated for t in g][:max_new_tokens]
                return LlamaCppGenerationOutput(tokens, len(tokens), forwards, steps_per_block)
            if carried is None:
                pending = kept

    def _autoregressive(self, prompt, max_new_tokens, rule, streamer) -> LlamaCppGenerationOutput:
        """llama.cpp's own causal greedy decoding of the same file: one token per forward."""
        self._prefill(prompt[:-1])
        token, position, tokens = prompt[-1], len(prompt) - 1, []
        while len(tokens) < max_new_tokens:
            token = int(self._decode([token], position, self._main, outputs=[0], causal=True)[0].argmax())
            position += 1
            tokens.append(token)
            if streamer is not None:
                streamer([token])
            if token in self.eos_token_ids:
                break
        return LlamaCppGenerationOutput(tokens, len(tokens), len(tokens), [])

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _TensorBufferOverride(ctypes.Structure):  # llama.h's llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _experts_on_cpu():
    """A NULL-terminated override list placing every routed-expert tensor in the CPU's buffer type."""
    from llama_cpp import _ggml

    ggml = _ggml.libggml
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    cpu = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
    return (_TensorBufferOverride * 2)(
        _TensorBufferOverride(rb"\.ffn_(up|down|gate)_exps", cpu), _TensorBufferOverride()
    )


def _cap(steps_cap, steps_done):
    """Steps left under `max_steps_per_block` after `steps_done` (None: no cap)."""
    return None if steps_cap is None else max(steps_cap - steps_done, 1)


@dataclass
class _Rule:
    """The LowConfidence step of generation_clover on logits from llama.cpp."""

    mask_token_id: int
    eos_ids: torch.Tensor
    threshold: float
    processors: LogitsProcessorList
    warpers: LogitsProcessorList | None
    generator: torch.Generator | None

    def step(self, logits, canvas, to_decode, columns, steps_left, context):
        """logits (len(columns), vocab) at the canvas `columns`; returns (canvas, committed positions)."""
        scores = logits.float()
        scores[:, self.mask_token_id] = -math.inf  # never propose the mask itself
        if len(self.processors):
            scores = self.processors(context[None].expand(len(columns), -1), scores)
        sampling_scores = self.warpers(None, scores) if self.warpers is not None else None
        candidate_at, confidence_at = candidates_and_confidence(scores, sampling_scores, self.generator)
        candidate = canvas.clone()
        candidate[columns] = candidate_at
        confidence = torch.zeros(canvas.shape)
        confidence[columns] = confidence_at
        commit = select_positions_to_commit(
            confidence[None], to_decode[None], self.threshold, min_commits_per_step(to_decode[None], steps_left)
        )[0]
        return torch.where(commit, candidate, canvas), commit

    def stop_after_eos(self, canvas, to_decode):
        """A committed EOS with nothing masked before it ends the block: what follows becomes pad."""
        if self.eos_ids.numel() == 0:
            return to_decode
        is_eos = torch.isin(canvas, self.eos_ids) & ~to_decode
        first = int(first_eos_index(canvas[None], self.eos_ids, is_eos[None])[0])
        index = torch.arange(canvas.shape[0])
        if bool((to_decode & (index < first)).any()):
            return to_decode
        return to_decode & ~(index > first)


def _finish(new, max_new_tokens, eos_ids, forwards, steps_per_block) -> LlamaCppGenerationOutput:
    tokens = torch.tensor(new[:max_new_tokens])
    count = min(int(first_eos_index(tokens[None], eos_ids)[0]) + 1, len(tokens))
    return LlamaCppGenerationOutput(tokens[:count].tolist(), count, forwards, steps_per_block)


__all__ = ["STRATEGIES", "LlamaCppClover", "LlamaCppGenerationOutput"]
