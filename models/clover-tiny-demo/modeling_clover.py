"""Clover: the Qwen3.5-MoE text stack (Gated DeltaNet + gated attention + MoE) decoding by block diffusion.

Reading order: norms -> rotary -> masks -> gated delta rule -> Gated DeltaNet -> attention -> MoE -> layer ->
PreTrainedModel -> CloverModel -> CloverForBlockDiffusion.

Three kinds of forward share the same layers:
* causal (no `block_ids`): exactly the autoregressive Qwen3.5-MoE;
* block-causal (`block_ids`): tokens of a block see each other and everything before the block (docs/DESIGN.md §4);
* training (`noisy_input_ids`): the clean sequence followed by its noised answer blocks, each noisy block seeing the
  clean context before it, so one forward covers every block of the objective.
With a `CloverCache`, a forward reads the committed tokens and appends only its first `commit_length` tokens.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput, logging

from .cache_clover import CloverCache
from .configuration_clover import CloverConfig, check_token_ids
from .generation_clover import CloverGenerationMixin
from .quantization_clover import (
    EXPERT_PARAMETERS,
    FP32_STATISTICS,
    load_time_spec,
    prepare_quantized_storage,
    quantize_tensor,
    stored_spec,
    unpack_cpu_4bit_layers,
    with_unquantized_gates,
)

try:
    from transformers.integrations import use_experts_implementation
except ImportError:  # pragma: no cover - every supported transformers ships it

    def use_experts_implementation(cls):
        return cls


logger = logging.get_logger(__name__)

try:  # Optional CUDA kernels: used on GPU when installed, torch fallbacks otherwise.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_chunk_gated_delta_rule = None
try:
    from causal_conv1d import causal_conv1d_fn as cuda_causal_conv1d_fn
except ImportError:
    cuda_causal_conv1d_fn = None


# --------------------------------------------------------------------------------------------------------------------
# Norms and rotary embedding
# --------------------------------------------------------------------------------------------------------------------


class CloverRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: the scale is `1 + weight` (Qwen3.5's convention)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: bf16 mean-of-squares loses the small channels.
        normed = hidden_states.float() * torch.rsqrt(hidden_states.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(hidden_states)


class CloverRMSNormGated(nn.Module):
    """RMSNorm of the Gated DeltaNet output, then a SiLU gate: `weight * norm(x) * silu(z)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden_states = self.weight * hidden_states.to(dtype)
        return (hidden_states.float() * F.silu(gate.float())).to(dtype)


def rotary_inverse_frequencies(config: CloverConfig) -> torch.Tensor:
    dim = config.rotary_dim
    return 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class CloverRotaryEmbedding(nn.Module):
    """Partial RoPE: only the first `rotary_dim` channels of each head rotate (a quarter of 256 in Clover).

    Qwen3.5's mRoPE gives text tokens the same position on its three axes, which is plain RoPE.
    """

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.register_buffer("inv_freq", rotary_inverse_frequencies(config), persistent=False)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(hidden_states.device)  # (batch, seq, dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first `cos.shape[-1]` channels of `x` (batch, heads, seq, head_dim); the rest pass through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


# --------------------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------------------


def block_causal_mask(
    block_ids: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    past_length: int | torch.Tensor = 0,
    key_length: int | None = None,
) -> torch.Tensor:
    """Which keys each query may attend to in a block-causal forward (docs/DESIGN.md §4). `True` means "attend".

    `block_ids` (batch, q_len) gives -1 for causal context and k >= 0 for the tokens of block k. The `past_length`
    committed keys in front (a cache) are visible to every query. For context C, block 0 = (a b), block 1 = (c d):

              C  a  b  c  d
          C   x  .  .  .  .      causal context: itself and what precedes it
          a   x  x  x  .  .      block 0: the context and all of block 0
          b   x  x  x  .  .
          c   x  x  x  x  x      block 1: everything before it and all of block 1
          d   x  x  x  x  x

    `key_padding_mask` (batch, <= key_length), 1 for real tokens, hides padding (keys it does not cover count as
    padding). Every query also sees itself, so a padding row never softmaxes over nothing (its output is discarded).

    `key_length` defaults to `past_length + q_len`. A static cache passes its whole buffer length and `past_length`
    as a tensor: the keys past this forward's tokens are then hidden, and the mask's shape never changes.

    Returns: bool (batch, 1, q_len, key_length).
    """
    batch_size, q_len = block_ids.shape
    device = block_ids.device
    if key_length is None:
        key_length = past_length + q_len
    query_index = torch.arange(q_len, device=device) + past_length
    key_index = torch.arange(key_length, device=device)
    # The block of every key: this forward's own tokens carry theirs, committed (and unused) keys belong to none.
    offset = key_index - past_length
    in_forward = (offset >= 0) & (offset < q_len)
    own_block = block_ids.gather(1, offset.clamp(0, q_len - 1).expand(batch_size, -1))
    key_block_ids = torch.where(in_forward, own_block, -1)

    causal = key_index[None, None, :] <= query_index[None, :, None]  # (1, q, k)
    same_block = (block_ids[:, :, None] == key_block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)  # (b, q, k)
    allowed = causal | same_block
    if key_padding_mask is not None:
        key_padding_mask = F.pad(key_padding_mask.bool(), (0, key_length - key_padding_mask.shape[-1]), value=False)
        allowed = allowed & key_padding_mask[:, None, :]
    allowed = allowed | (key_index[None, None, :] == query_index[None, :, None])
    return allowed[:, None]


@dataclass(frozen=True)
class WholeBlocks:
    """The mask of an unpadded forward on a dynamic cache whose tokens are whole consecutive blocks (in decoding: a
    finished block and the next block's canvas), kept implicit. The queries of the j-th block see the cache and
    every token up to the end of that block, so attention runs block by block over a prefix of the keys with no
    mask: no `(queries, keys)` tensor is built, and SDPA keeps its mask-free kernels."""

    block_size: int
    forward_length: int  # this forward's tokens
    past_length: int  # committed keys in front

    def spans(self) -> list[tuple[int, int, int]]:
        """(first query, end query, keys seen) for each block of the forward."""
        spans = []
        for start in range(0, self.forward_length, self.block_size):
            end = min(start + self.block_size, self.forward_length)
            spans.append((start, end, self.past_length + end))
        return spans

    def for_queries(self, query_positions: torch.Tensor) -> torch.Tensor | None:
        """The mask of the forward's `query_positions` alone: none when they all lie in the last block (which sees
        every key, as in a decoding step's last layer), else the materialized bool mask's rows."""
        last_start = (self.forward_length - 1) // self.block_size * self.block_size
        if int(query_positions.min()) >= last_start:
            return None
        columns = torch.arange(self.forward_length, device=query_positions.device)
        mask = block_causal_mask((columns // self.block_size)[None], past_length=self.past_length)
        return mask[:, :, query_positions]


def training_mask(
    block_ids: torch.Tensor, key_padding_mask: torch.Tensor | None, answer_start: int, block_size: int
) -> torch.Tensor:
    """The mask of a training forward over `[clean sequence (L), noisy answer blocks (A)]`.

    The clean part is block-causal (so its states are those a cache would hold after committing each block). The
    noisy copy of block k sees the clean tokens before block k starts, and the noisy tokens of block k itself:

                    clean: C  b0 b1   noisy: n0 n1
          clean C          x  .  .           .  .
          clean b0         x  x  .           .  .
          clean b1         x  x  x           .  .
          noisy n0         x  .  .           x  .
          noisy n1         x  x  .           .  x

    Returns: bool (batch, 1, L + A, L + A).
    """
    batch_size, clean_length = block_ids.shape
    answer_length = clean_length - answer_start
    device = block_ids.device
    clean_mask = block_causal_mask(block_ids, key_padding_mask)[:, 0]  # (b, L, L)

    noisy_block = torch.arange(answer_length, device=device) // block_size  # (A,)
    noisy_sees_clean = (
        torch.arange(clean_length, device=device)[None, :] < (answer_start + noisy_block * block_size)[:, None]
    )  # (A, L)
    noisy_sees_clean = noisy_sees_clean[None].expand(batch_size, -1, -1)
    if key_padding_mask is not None:
        noisy_sees_clean = noisy_sees_clean & key_padding_mask[:, None, :].bool()
    noisy_sees_noisy = (noisy_block[:, None] == noisy_block[None, :])[None].expand(batch_size, -1, -1)  # (b, A, A)

    top = torch.cat([clean_mask, clean_mask.new_zeros(batch_size, clean_length, answer_length)], dim=-1)
    bottom = torch.cat([noisy_sees_clean, noisy_sees_noisy], dim=-1)
    return torch.cat([top, bottom], dim=1)[:, None]


# --------------------------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------------------------


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gated delta rule, exact up to rounding, computed chunk by chunk (torch reference path).

    Per head, with state S (k_dim, v_dim), each token does
        S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t.
    Inside a chunk the u's solve one unit-lower-triangular system (the WY form), so the only sequential work is
    carrying S from chunk to chunk.

    Args: query/key (batch, seq, heads, k_dim), already L2-normalised and (query) scaled; value (batch, seq, heads,
        v_dim); g (log decay, <= 0) and beta (batch, seq, heads); initial_state (batch, heads, k_dim, v_dim).
    Returns: output (batch, seq, heads, v_dim) in value's dtype; the final state (fp32; None without
        `output_final_state`: a denoising forward only reads); with `output_chunk_states` the state at the start of
        every chunk (batch, heads, num_chunks, k_dim, v_dim).
    """
    batch_size, seq_len, num_heads, k_dim = key.shape
    v_dim = value.shape[-1]
    out_dtype = value.dtype
    chunk_size = max(1, min(chunk_size, seq_len))  # a short input (a decoding block) is one unpadded chunk
    # fp32 throughout: the decays multiply over hundreds of tokens.
    query, key, value, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))
    pad = (-seq_len) % chunk_size
    if pad:  # padded tokens have beta = 0 (no write) and g = 0 (no decay): the state passes through unchanged
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(x):
        return x.reshape(batch_size, num_heads, num_chunks, chunk_size, *x.shape[3:])

    query, key, value, g, beta = map(chunked, (query, key, value, g, beta))
    log_decay = g.cumsum(-1)  # (b, h, n, c): log of the decay from the chunk start to each token
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=key.device).tril()
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~lower, -math.inf).exp()

    # (I + A) u = beta v - beta exp(log_decay) K S0, with A[i, j] = beta_i decay(i<-j) k_i.k_j for j < i.
    strict = (key @ key.transpose(-1, -2)) * pair_decay * beta[..., None]
    system = torch.eye(chunk_size, device=key.device) + strict.masked_fill(~lower.tril(-1), 0.0)
    # Both right-hand sides in one solve: (b, h, n, c, v + k).
    rhs = torch.cat([value * beta[..., None], key * (beta * log_decay.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    value_part, state_part = solved[..., :v_dim], solved[..., v_dim:]
    attn = (query @ key.transpose(-1, -2)) * pair_decay  # (b, h, n, c, c), causal inside the chunk
    query_decayed = query * log_decay.exp()[..., None]
    # Each token's decay to its chunk's end, which carries the state on (past the last chunk only when wanted).
    carried = output_final_state or num_chunks > 1
    key_to_end = key * (log_decay[..., -1:] - log_decay).exp()[..., None] if carried else None

    state = (
        initial_state.float()
        if initial_state is not None
        else key.new_zeros(batch_size, num_heads, k_dim, v_dim, dtype=torch.float)
    )
    outputs, chunk_states = [], []
    for n in range(num_chunks):
        chunk_states.append(state)
        u = value_part[:, :, n] - state_part[:, :, n] @ state  # (b, h, c, v)
        outputs.append(query_decayed[:, :, n] @ state + attn[:, :, n] @ u)
        if n < num_chunks - 1 or output_final_state:
            state = state * log_decay[:, :, n, -1, None, None].exp() + key_to_end[:, :, n].transpose(-1, -2) @ u

    output = torch.stack(outputs, dim=2).reshape(batch_size, num_heads, -1, v_dim)[:, :, :seq_len]
    states = torch.stack(chunk_states, dim=2) if output_chunk_states else None
    return output.transpose(1, 2).to(out_dtype), state if output_final_state else None, states


def gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state: bool = True):
    """Dispatches to the fla kernel on CUDA when installed, else the torch reference. Returns (output, state), the
    state None without `output_final_state`."""
    if fla_chunk_gated_delta_rule is not None and query.is_cuda:
        scale = 1.0  # our queries arrive already scaled
        return fla_chunk_gated_delta_rule(
            query, key, value, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
        )  # fmt: skip
    output, state, _ = chunk_gated_delta_rule(
        query, key, value, g, beta, initial_state, output_final_state=output_final_state
    )
    return output, state


def gated_delta_rule_with_commit(query, key, value, g, beta, initial_state, commit_length: int):
    """A fused commit + denoise: the outputs of every token and the state after the first `commit_length` tokens
    (the state the cache keeps); the tokens after them read that state and change nothing."""
    if not (fla_chunk_gated_delta_rule is not None and query.is_cuda):
        # One torch call with chunks of the commit's length (a block, when decoding): the state at the first chunk
        # boundary is the committed one.
        output, _, chunk_states = chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, chunk_size=commit_length, output_chunk_states=True
        )
        return output, chunk_states[:, :, 1]
    c = commit_length
    head, committed = gated_delta_rule(query[:, :c], key[:, :c], value[:, :c], g[:, :c], beta[:, :c], initial_state)
    tail, _ = gated_delta_rule(query[:, c:], key[:, c:], value[:, c:], g[:, c:], beta[:, c:], committed)
    return torch.cat([head, tail], dim=1), committed


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps): the eps inside the root, as the fla kernels (and Qwen3.5's checkpoints) expect."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(inputs: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv + SiLU. inputs (batch, channels, seq); weight (channels, kernel);
    window (batch, channels, kernel - 1): the inputs before this segment (zeros at the sequence start)."""
    kernel = weight.shape[-1]
    if window is None:
        if cuda_causal_conv1d_fn is not None and inputs.is_cuda:
            return cuda_causal_conv1d_fn(inputs, weight, None, activation="silu")
        window = inputs.new_zeros(inputs.shape[0], inputs.shape[1], kernel - 1)
    padded = torch.cat([window.to(inputs.dtype), inputs], dim=-1)
    # A sum of `kernel` shifted products: for a decoding block it costs a fraction of a conv1d call, and over a
    # training sequence no more. Accumulated in fp32 (at least), as the conv kernels do.
    length, weight = inputs.shape[-1], weight.to(torch.promote_types(inputs.dtype, torch.float32))
    output = padded[..., :length] * weight[:, :1]
    for shift in range(1, kernel):
        output = output + padded[..., shift : shift + length] * weight[:, shift : shift + 1]
    return F.silu(output).to(inputs.dtype)


class CloverCausalConv1d(nn.Conv1d):
    """The depthwise causal conv of the Gated DeltaNet: an `nn.Conv1d` (checkpoint name `conv1d.weight`) that is
    always called as a module, because offloading hooks (accelerate's cpu/disk offload) load a module's weight only
    while its own forward runs; read from the parent, `conv1d.weight` would be an empty meta tensor."""

    def forward(self, inputs: torch.Tensor, window: torch.Tensor | None = None) -> torch.Tensor:
        return causal_depthwise_conv(inputs, self.weight.squeeze(1), window)


# --------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class TrainingLayout:
    """Where the noisy answer blocks of a training forward sit: clean tokens [0, clean_length), the answer starting
    at `answer_start` in every row, noisy copies of its blocks after the clean part."""

    clean_length: int
    answer_start: int
    block_size: int


class CloverGatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (linear attention with a delta-rule state), parameter names as in Qwen3.5-MoE."""

    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim

        self.conv1d = CloverCausalConv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size, bias=False, groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(1, 16)))
        self.norm = CloverRMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)

    def _split_heads(self, mixed_qkv: torch.Tensor):
        """(batch, seq, conv_dim) after the conv -> normalised q, k and v per value head."""
        batch_size, seq_len, _ = mixed_qkv.shape
        query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, self.num_k_heads, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, self.num_k_heads, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, self.num_v_heads, self.head_v_dim)
        # l2-normalised q and k keep the state bounded; q also carries the 1/sqrt(d) attention scale.
        query = l2_normalize(query.float()) * self.head_k_dim**-0.5
        key = l2_normalize(key.float())
        repeats = self.num_v_heads // self.num_k_heads  # each q/k head serves consecutive value heads
        if repeats > 1:
            query = query.repeat_interleave(repeats, dim=2)
            key = key.repeat_interleave(repeats, dim=2)
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: CloverCache | None = None,
        commit_length: int = 0,
        layout: TrainingLayout | None = None,
    ) -> torch.Tensor:
        if padding_mask is not None:  # padding must not enter the conv window nor the state
            hidden_states = hidden_states * padding_mask[..., None].to(hidden_states.dtype)
        batch_size, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)  # (batch, conv_dim, seq)
        gate = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        # fp32 decay: exp(A_log) * softplus(.) overflows easily in fp16.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)

        if layout is not None:
            core = self._training_mix(mixed_qkv, g, beta, layout)
        else:
            window = cache.conv_states[self.layer_idx] if cache is not None else None
            state = cache.recurrent_states[self.layer_idx] if cache is not None else None
            conv_out = self.conv1d(mixed_qkv, window).transpose(1, 2)
            query, key, value = self._split_heads(conv_out)
            if cache is not None and 0 < commit_length < seq_len:  # the committed prefix advances the state
                core, committed_state = gated_delta_rule_with_commit(query, key, value, g, beta, state, commit_length)
            else:  # all committed, or nothing (a denoising forward only reads the state)
                core, committed_state = gated_delta_rule(
                    query, key, value, g, beta, state, output_final_state=cache is not None and commit_length > 0
                )
            if cache is not None and commit_length > 0:
                cache.update_linear(self.layer_idx, mixed_qkv[:, :, :commit_length], committed_state)

        core = self.norm(core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch_size, seq_len, self.value_dim))

    def _training_mix(self, mixed_qkv, g, beta, layout: TrainingLayout) -> torch.Tensor:
        """Clean part: one causal scan. Noisy block k: the conv window and state the clean scan had at block k."""
        L, S, bs = layout.clean_length, layout.answer_start, layout.block_size
        batch_size, channels, total = mixed_qkv.shape
        num_blocks = (total - L) // bs
        clean_qkv, noisy_qkv = mixed_qkv[:, :, :L], mixed_qkv[:, :, L:]

        clean = self.conv1d(clean_qkv).transpose(1, 2)
        query, key, value = self._split_heads(clean)
        prefix_out, prefix_state, _ = chunk_gated_delta_rule(
            query[:, :S], key[:, :S], value[:, :S], g[:, :S], beta[:, :S]
        )
        answer_out, _, block_states = chunk_gated_delta_rule(
            query[:, S:L], key[:, S:L], value[:, S:L], g[:, S:L], beta[:, S:L],
            initial_state=prefix_state, chunk_size=bs, output_chunk_states=True,
        )  # fmt: skip

        # Conv windows: the kernel - 1 clean inputs before each block (zeros before the sequence start).
        kernel = self.conv_kernel_size
        padded_clean = F.pad(clean_qkv, (kernel - 1, 0))
        starts = S + torch.arange(num_blocks, device=mixed_qkv.device) * bs  # block starts, in unpadded columns
        window_index = starts[:, None] + torch.arange(kernel - 1, device=mixed_qkv.device)  # (blocks, kernel - 1)
        windows = padded_clean[:, :, window_index]  # (batch, channels, blocks, kernel - 1)
        noisy_segments = torch.cat([windows, noisy_qkv.reshape(batch_size, channels, num_blocks, bs)], dim=-1)
        noisy_segments = noisy_segments.permute(0, 2, 1, 3).reshape(batch_size * num_blocks, channels, -1)
        noisy = self.conv1d(noisy_segments[:, :, kernel - 1 :], noisy_segments[:, :, : kernel - 1])
        query, key, value = self._split_heads(noisy.transpose(1, 2))  # (batch * blocks, bs, ...)

        def per_block(x):  # (batch, blocks * bs, ...) -> (batch * blocks, bs, ...)
            return x.reshape(batch_size * num_blocks, bs, *x.shape[2:])

        initial = block_states.transpose(1, 2).reshape(batch_size * num_blocks, *block_states.shape[1:2], *block_states.shape[3:])  # fmt: skip
        noisy_out, _, _ = chunk_gated_delta_rule(
            query, key, value, per_block(g[:, L:]), per_block(beta[:, L:]), initial_state=initial, chunk_size=bs
        )
        noisy_out = noisy_out.reshape(batch_size, num_blocks * bs, *noisy_out.shape[2:])
        return torch.cat([prefix_out, answer_out, noisy_out], dim=1)


# --------------------------------------------------------------------------------------------------------------------
# Gated full attention
# --------------------------------------------------------------------------------------------------------------------


def eager_attention(query, key, value, mask, scaling):
    """Reference attention. query (b, h, q, d); key/value (b, kv_heads, k, d); mask bool (b, 1, q, k), or None when
    every query sees every key."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # fp32 softmax: bf16 sums drift
    return probs @ value


def sdpa_attention(query, key, value, mask, scaling):
    # enable_gqa reads the shared KV heads in place: no repeated copy of a long cache per step.
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


ATTENTION_FUNCTIONS = {"eager": eager_attention, "sdpa": sdpa_attention}


class CloverAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial RoPE, grouped KV heads and a sigmoid output gate."""

    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        # q_proj yields, per head, the query followed by its output gate.
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = CloverRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = CloverRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: CloverCache | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`query_positions` (1-D): attend from these columns only (every column still gives its key and value);
        the output then covers just them."""
        batch_size, seq_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        key = self.k_proj(hidden_states).view(batch_size, seq_len, self.num_kv_heads, self.head_dim)
        key = apply_partial_rotary(self.k_norm(key).transpose(1, 2), cos, sin)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:  # committed keys, then this forward's (only the first commit_length stay committed)
            key, value = cache.attention_kv(self.layer_idx, key, value)
        if query_positions is not None:
            if query_positions.numel() == 0:  # only the cache reads this forward (and 4-bit kernels reject 0 rows)
                return hidden_states[:, :0]
            cos, sin = cos[:, query_positions], sin[:, query_positions]
            hidden_states = hidden_states[:, query_positions]
            if isinstance(attention_mask, WholeBlocks):
                attention_mask = attention_mask.for_queries(query_positions)
            elif attention_mask is not None:
                attention_mask = attention_mask[:, :, query_positions]
            seq_len = hidden_states.shape[1]
        query = self.q_proj(hidden_states).view(batch_size, seq_len, self.num_heads, 2 * self.head_dim)
        query, gate = query.chunk(2, dim=-1)
        gate = gate.reshape(batch_size, seq_len, self.num_heads * self.head_dim)
        query = apply_partial_rotary(self.q_norm(query).transpose(1, 2), cos, sin)  # (batch, heads, seq, head_dim)

        attention = ATTENTION_FUNCTIONS[self.config._attn_implementation]
        if isinstance(attention_mask, WholeBlocks):  # block by block, each over the keys it sees, no mask
            spans = attention_mask.spans()
            output = torch.cat(
                [
                    attention(query[:, :, a:b], key[:, :, :seen], value[:, :, :seen], None, self.scaling)
                    for a, b, seen in spans
                ],
                dim=2,
            )
        else:
            output = attention(query, key, value, attention_mask, self.scaling)  # (batch, heads, seq, head_dim)
        output = output.transpose(1, 2).reshape(gate.shape) * torch.sigmoid(gate)
        return self.o_proj(output)


# --------------------------------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------------------------------


class CloverMLP(nn.Module):
    def __init__(self, config: CloverConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@use_experts_implementation
class CloverExperts(nn.Module):
    """The routed experts as two fused 3D tensors: gate_up_proj (experts, 2 * inter, hidden), down_proj (experts,
    hidden, inter). `config._experts_implementation` picks this eager loop or transformers' grouped_mm kernels.

    Quantized experts (see `quantization_clover`): a checkpoint saved quantized (`config.experts_quantization`) is
    built in its storage format and loads as it is; a 16-bit checkpoint loaded with a bitsandbytes
    `quantization_config` has each tensor quantized as the loader assigns it."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size))  # fmt: skip
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.moe_intermediate_size))  # fmt: skip
        self.act_fn = ACT2FN[config.hidden_act]
        if config.experts_quantization:
            prepare_quantized_storage(self, config.experts_quantization)
        self._quantize_on_assign = load_time_spec(config)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        spec = self.__dict__.get("_quantize_on_assign")
        loaded = isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type != "meta"
        if spec and name in EXPERT_PARAMETERS and loaded and not parametrize.is_parametrized(self, name):
            quantize_tensor(self, name, spec)  # the loader's 16-bit tensor goes as soon as it is quantized

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():  # only the experts some token chose
            token_index, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token_index], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            output.index_add_(0, token_index, (expert_out * top_k_weights[token_index, slot, None]).to(output.dtype))
        return output


class CloverRouter(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor):
        router_logits = F.linear(hidden_states, self.weight)  # (tokens, experts)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_weights, top_index = probs.topk(self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)  # renormalised over the chosen experts
        return router_logits, top_weights.to(router_logits.dtype), top_index


class CloverSparseMoeBlock(nn.Module):
    """Top-k routed experts plus one always-on shared expert scaled by a sigmoid gate."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.gate = CloverRouter(config)
        self.experts = CloverExperts(config)
        self.shared_expert = CloverMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, shape[-1])
        router_logits, top_weights, top_index = self.gate(hidden_states)
        routed = self.experts(hidden_states, top_index, top_weights)
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return (routed + shared).reshape(shape), router_logits


# --------------------------------------------------------------------------------------------------------------------
# Decoder layer
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class CloverForwardContext:
    """What every decoder layer of one forward reads besides the hidden states, built once by `CloverModel`.

    Args:
        position_embeddings: the rotary (cos, sin) of the forward's positions.
        attention_mask: the full-attention layers' mask: a bool `(batch, 1, queries, keys)` tensor, a `WholeBlocks`
            (whole unpadded blocks, kept implicit), or None (no mask at all).
        padding_mask (`(batch, seq_len)`, 1 for real tokens): keeps padding out of the Gated DeltaNet scan and conv.
        cache: the committed cache, or None.
        commit_length: how many leading tokens of the forward enter the cache.
        layout: where the noisy answer blocks of a training forward sit, else None.
    """

    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor | WholeBlocks | None
    padding_mask: torch.Tensor | None = None
    cache: CloverCache | None = None
    commit_length: int | torch.Tensor = 0
    layout: TrainingLayout | None = None


class CloverDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = CloverGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = CloverAttention(config, layer_idx)
        self.mlp = CloverSparseMoeBlock(config)
        self.input_layernorm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: CloverForwardContext,
        positions_to_keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions_to_keep` (1-D): the columns whose output is wanted (the last layer of a decoding forward);
        the others still give their attention keys and values, or their Gated DeltaNet state, to the cache."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "linear_attention":  # the scan needs every column; its output is cut after
            hidden_states = self.linear_attn(
                hidden_states, context.padding_mask, context.cache, context.commit_length, context.layout
            )
            if positions_to_keep is not None:
                hidden_states = hidden_states[:, positions_to_keep]
        else:
            hidden_states = self.self_attn(
                hidden_states, context.position_embeddings, context.attention_mask, context.cache, positions_to_keep
            )
        if positions_to_keep is not None:
            if positions_to_keep.numel() == 0:  # the cache has what it needs: nothing is left to compute
                return hidden_states, hidden_states.new_zeros(0, self.mlp.gate.weight.shape[0])
            residual = residual[:, positions_to_keep]
        hidden_states = residual + hidden_states
        moe_out, router_logits = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + moe_out, router_logits


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


# The files of a whole model's weights, as transformers names them: single file, shards, index (safetensors or bin).
WEIGHT_FILE = re.compile(
    r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)|(model\.safetensors|pytorch_model\.bin)\.index\.json"
)


@contextmanager
def _previous_weights_set_aside(directory: Path):
    """Moves the weight files in `directory` into a hidden folder inside it for the duration of the block; deletes
    them when it succeeds and moves them back when it fails (a kill leaves them in the hidden folder)."""
    previous = [path for path in directory.iterdir() if WEIGHT_FILE.fullmatch(path.name)] if directory.is_dir() else []
    if not previous:
        yield
        return
    aside = Path(tempfile.mkdtemp(prefix=".previous-weights-", dir=directory))
    for path in previous:
        path.rename(aside / path.name)
    try:
        yield
    except BaseException:
        for path in previous:  # over whatever the failed save left half-written
            (aside / path.name).replace(path)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _unreadable_safetensors(checkpoint, kwargs) -> Path | None:
    """The first .safetensors file of a local checkpoint directory that safetensors cannot open, if any."""
    folder = None if checkpoint is None else Path(checkpoint, kwargs.get("subfolder") or "")
    if folder is None or not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):  # the header must describe exactly the bytes that follow it
                pass
        except SafetensorError:
            return path
    return None


def _is_trl_fused_head(function) -> bool:
    """Whether `function` is the forward TRL's `add_fused_lm_head` installs (it wraps the model's own, so only its
    code object tells)."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in Path(code.co_filename).parts


def _unpack_cpu_4bit_layers_hook(module, prefix, keep_vars) -> None:
    unpack_cpu_4bit_layers(module)


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverConfig
    config: CloverConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CloverDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False  # FlashAttention ignores custom masks, and block masks are custom
    _supports_flex_attn = False
    _is_stateful = True
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^model\.visual\."]
    _keep_in_fp32_modules_strict = [FP32_STATISTICS]  # quantized experts' statistics

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # A bitsandbytes config leaves the routers and gates 16-bit (see quantization_clover.with_unquantized_gates).
        if kwargs.get("quantization_config") is not None:
            kwargs["quantization_config"] = with_unquantized_gates(kwargs["quantization_config"])
        try:
            return super().from_pretrained(*args, **kwargs)
        except SafetensorError as error:  # safetensors does not say which file it could not read
            broken = _unreadable_safetensors(args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs)
            if broken is None:
                raise
            raise OSError(
                f"{broken} is not a readable safetensors file ({error}): it is truncated or damaged, e.g. by an "
                "interrupted download, copy or save. Download or save it again."
            ) from error

    def post_init(self):
        super().post_init()
        # Before any state_dict (save_pretrained, PEFT, Trainer checkpoints): bitsandbytes' own inverse of its CPU
        # 4-bit repacking scrambles the statistics it saves.
        self._unpack_hook = self.register_state_dict_pre_hook(_unpack_cpu_4bit_layers_hook)
        if spec := load_time_spec(self.config):  # every CloverExperts quantizes its tensors as the loader assigns them
            self.config.experts_quantization = spec

    def save_pretrained(self, save_directory, *args, **kwargs):
        # The config records how the experts are stored, so from_pretrained builds them in that format (a quantized
        # model saves a pre-quantized checkpoint; see quantization_clover).
        self.config.experts_quantization = stored_spec(self)
        if not kwargs.get("is_main_process", True):
            return super().save_pretrained(save_directory, *args, **kwargs)
        # Weights of an earlier save that this one would not overwrite (a single model.safetensors beside new shards,
        # or old shards beside a new single file) would be loaded instead of the new ones, or beside them: they are
        # moved aside for the save, deleted after it, and put back if it fails.
        with _previous_weights_set_aside(Path(save_directory)):
            return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # transformers' init functions skip tensors already loaded from a checkpoint; raw in-place ops would not.
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            # PyTorch's default for the short depthwise conv: uniform in +-1/sqrt(kernel).
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, CloverRMSNorm):
            init.zeros_(module.weight)  # zero-centred: scale 1
        elif isinstance(module, CloverRMSNormGated):
            init.ones_(module.weight)
        elif isinstance(module, CloverGatedDeltaNet):
            init.ones_(module.dt_bias)
            # Decay rates spread over [1, 16] so heads remember on different time scales.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log())
        elif isinstance(module, CloverExperts) and not parametrize.is_parametrized(module):  # quantized: as loaded
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, CloverRouter):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, CloverRotaryEmbedding):
            # A non-persistent buffer: never in a checkpoint, so recomputed after every load.
            init.copy_(module.inv_freq, rotary_inverse_frequencies(self.config))


@dataclass
class CloverModelOutput(ModelOutput):
    """
    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, seq_len, hidden_size)`): after the final norm.
        cache (`CloverCache`): the committed cache, when one was used (also readable as `past_key_values`).
        router_logits (`tuple[torch.FloatTensor]`, each `(batch * seq_len, num_experts)`): with output_router_logits.
    """

    last_hidden_state: torch.FloatTensor | None = None
    cache: CloverCache | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None

    @property
    def past_key_values(self) -> CloverCache | None:
        return self.cache


class CloverModel(CloverPreTrainedModel):
    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(CloverDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = CloverRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: CloverCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        block_ids: torch.LongTensor | int | None = None,
        commit_length: int | None = None,
        noisy_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool = False,
        positions_to_keep: torch.LongTensor | None = None,
        **kwargs,
    ) -> CloverModelOutput:
        r"""
        block_ids (`torch.LongTensor` of shape `(batch, seq_len)` or `int`, *optional*):
            -1 for causal context, k >= 0 for the tokens of block k (contiguous). Without it the forward is causal.
            An int k >= 0 makes the forward's tokens blocks k, k + 1, ... of `block_size` each (a forward no longer
            than a block is all block k). Without `attention_mask` (no padding) and with no static cache, attention
            then runs without a mask: a one-block forward (a denoising step) sees every key; a longer one (a
            finished block and the next block's canvas) attends block by block over the keys each block sees.
        commit_length (`int`, *optional*):
            With a cache: how many leading tokens of this forward enter the cache. Defaults to all of them when
            `use_cache`, else none (a read-only denoising forward).
        noisy_input_ids (`torch.LongTensor` of shape `(batch, answer_len)`, *optional*):
            Training forward: noised copies of the answer blocks (`block_ids >= 0`), run after the clean sequence;
            the output covers the clean tokens then the noisy ones.
        positions_to_keep (`torch.LongTensor` of shape `(n,)`, *optional*):
            The columns of this forward whose final hidden states are wanted; the output covers just them, in that
            order. The last layer runs its queries, attention and MoE only there (every column still enters the
            cache), which is what a decoding forward needs: the positions still to decide, or none at all when the
            forward only commits (a prompt chunk). Without it, every column.
        """
        past_key_values = kwargs.pop("cache", None) if past_key_values is None else past_key_values
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        batch_size, seq_len = inputs_embeds.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and noisy_input_ids is None and not self.training:
            past_key_values = CloverCache(self.config)
        if past_key_values is None:
            commit_length = 0
        elif commit_length is None:
            commit_length = seq_len if use_cache else 0
        self._check_attention_mask(attention_mask, past_key_values, seq_len)
        past_length = past_key_values.length if past_key_values is not None else 0  # a 0-d tensor when static
        columns = past_length + torch.arange(seq_len, device=inputs_embeds.device)  # this forward's cache columns
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, columns, batch_size)
        padding_mask = None if attention_mask is None else attention_mask[:, columns]
        static = past_key_values is not None and past_key_values.static
        if padding_mask is not None and not static and bool(padding_mask.all()):
            padding_mask = None  # nothing to zero out: skip the multiply

        layout = None
        if noisy_input_ids is not None:
            layout = self._training_layout(block_ids, noisy_input_ids)
            inputs_embeds = torch.cat([inputs_embeds, self.embed_tokens(noisy_input_ids)], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, layout.answer_start :]], dim=1)
            mask = training_mask(block_ids, attention_mask, layout.answer_start, layout.block_size)
            if padding_mask is not None:
                padding_mask = F.pad(padding_mask, (0, noisy_input_ids.shape[1]), value=1)
        else:
            mask = self._block_mask(block_ids, attention_mask, past_key_values, batch_size, seq_len, columns.device)

        context = CloverForwardContext(
            self.rotary_emb(inputs_embeds, position_ids), mask, padding_mask, past_key_values, commit_length, layout
        )
        hidden_states, all_router_logits = self._decoder_stack(inputs_embeds, context, positions_to_keep)
        if past_key_values is not None:
            past_key_values.advance(commit_length)
        return CloverModelOutput(
            last_hidden_state=hidden_states,
            cache=past_key_values if use_cache or commit_length else None,
            router_logits=tuple(all_router_logits) if output_router_logits else None,
        )

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is not None:
            return inputs_embeds
        if not torch.compiler.is_compiling():
            check_token_ids(input_ids, self.config.vocab_size)
        return self.embed_tokens(input_ids)

    def _check_attention_mask(self, attention_mask, cache: CloverCache | None, seq_len: int) -> None:
        """The mask covers the committed tokens and this forward's; with a static cache, the whole buffer."""
        if attention_mask is None:
            return
        if cache is not None and cache.static:
            if attention_mask.shape[-1] != cache.max_length:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} tokens; with a static cache it must cover the "
                    f"whole buffer of {cache.max_length} (pad it with zeros)."
                )
            return
        past_length = cache.length if cache is not None else 0
        if attention_mask.shape[-1] != past_length + seq_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache holds {past_length} and the "
                f"input {seq_len}: pass a mask over the committed tokens and the new ones ({past_length + seq_len})."
            )

    def _block_mask(self, block_ids, attention_mask, cache, batch_size, seq_len, device) -> torch.Tensor | None:
        """The block-causal mask of this forward. With an int `block_ids`, no padding and a dynamic cache it stays
        implicit: None when the forward is one block (every query sees every key), else `WholeBlocks`; either way
        attention runs without a mask."""
        static = cache is not None and cache.static
        past_length = cache.length if cache is not None else 0
        if isinstance(block_ids, int):
            if block_ids < 0:
                raise ValueError(f"An int block_ids names the forward's first block: got {block_ids}, use >= 0.")
            block_size = self.config.block_size
            if attention_mask is None and not static:
                return None if seq_len <= block_size else WholeBlocks(block_size, seq_len, past_length)
            columns = torch.arange(seq_len, device=device)
            block_ids = (block_ids + columns // block_size).expand(batch_size, -1)
        elif block_ids is None:
            block_ids = torch.full((batch_size, seq_len), -1, dtype=torch.long, device=device)
        return block_causal_mask(block_ids, attention_mask, past_length, cache.max_length if static else None)

    def _decoder_stack(self, hidden_states, context: CloverForwardContext, keep: torch.Tensor | None):
        all_router_logits = []
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            hidden_states, router_logits = layer(hidden_states, context, keep if index == last else None)
            all_router_logits.append(router_logits)
        return self.norm(hidden_states), all_router_logits

    def _training_layout(self, block_ids, noisy_input_ids: torch.Tensor) -> TrainingLayout:
        """The noisy copies cover the answer: the last `noisy_input_ids.shape[1]` columns, all in blocks."""
        block_size = self.config.block_size
        answer_length = noisy_input_ids.shape[1]
        answer_start = block_ids.shape[1] - answer_length if isinstance(block_ids, torch.Tensor) else -1
        if (
            answer_start < 0
            or answer_length % block_size
            or not bool((block_ids[:, answer_start:] >= 0).all())
            or not bool((block_ids[:, :answer_start] < 0).all())
        ):
            raise ValueError(
                f"noisy_input_ids ({answer_length} columns) must cover the answer blocks: the last columns of every "
                f"row, marked by block_ids >= 0, a whole number of blocks of {block_size} (left-pad the prompts and "
                "right-pad the answers to whole blocks, as CloverDataCollator does)."
            )
        return TrainingLayout(block_ids.shape[1], answer_start, block_size)


def default_position_ids(attention_mask, columns: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded row gets the positions it would have alone. `columns`:
    the cache columns of this forward's tokens."""
    if attention_mask is None:
        return columns.expand(batch_size, -1)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, columns]


@dataclass
class CloverOutput(ModelOutput):
    """
    Args:
        loss (`torch.FloatTensor` of shape `()`): the block-diffusion loss (with `labels`).
        logits (`torch.FloatTensor` of shape `(batch, seq_len, vocab)`): no shift: position i predicts token i when
            it is masked. For a training forward, only the rows of the masked positions `(num_masked, vocab)`.
        cache (`CloverCache`): the committed cache (also readable as `past_key_values`).
        aux_loss (`torch.FloatTensor`): router load-balancing loss, with output_router_logits.
        log_probs, label_mask, entropy, is_top1 (`torch.FloatTensor` of shape `(batch, seq_len)`): with
            `fused_lm_head=True` (TRL's trainers), the objective per token, in the objective's layout: `loss =
            -log_probs.sum() / label_mask.sum()` (+ the aux loss); `label_mask` holds the supervised tokens'
            weights; `entropy` and `is_top1` are the masked tokens' prediction entropy and argmax hits, weighted
            1/t so that their sums over `label_mask.sum()` estimate the per-token means.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: CloverCache | None = None
    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    log_probs: torch.FloatTensor | None = None
    label_mask: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None
    is_top1: torch.FloatTensor | None = None

    @property
    def past_key_values(self) -> CloverCache | None:
        return self.cache


class CloverForBlockDiffusion(CloverPreTrainedModel, CloverGenerationMixin):
    # The loss is normalised inside (by supervised tokens); Trainer must still scale it for gradient accumulation.
    accepts_loss_kwargs = False
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.model = CloverModel(config)
        self.model._unpack_hook.remove()  # this model's own hook covers the inner one: one walk per state_dict
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.generation_config = self._default_generation_config(config)

    def __setattr__(self, name, value):
        # TRL's trainers replace `forward` by a fused head that scores next-token labels on the causal path: Clover
        # would then silently train as an autoregressive model. Its own forward answers `fused_lm_head=True` with
        # the block-diffusion objective's terms, so the replacement is declined.
        if name == "forward" and _is_trl_fused_head(value):
            logger.info("Clover computes TRL's fused-head outputs itself (the block-diffusion objective).")
            return
        super().__setattr__(name, value)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: CloverCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        block_ids: torch.LongTensor | int | None = None,
        commit_length: int | None = None,
        noise_mask: torch.BoolTensor | None = None,
        noise_level: torch.FloatTensor | None = None,
        label_weights: torch.FloatTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        fused_lm_head: bool = False,
        **kwargs,
    ) -> CloverOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch, seq_len)`, *optional*):
            Supervised answer tokens (-100 elsewhere). With labels the forward returns the block-diffusion loss
            (docs/DESIGN.md §7). Either a `CloverDataCollator` batch (with `block_ids`), whose answer blocks are
            noised by `noise_mask`/`noise_level`, or a causal-LM batch as Trainer-based clients pass it (no
            `block_ids`; labels aligned with `input_ids`, not shifted): every run of supervised labels is then an
            answer whose prompt is all that precedes it, laid out and noised as the collator does
            (`batch_from_labels`; the noise from torch's generator, so `transformers.set_seed` fixes it).
        noise_mask (`torch.BoolTensor` of shape `(batch, seq_len)`, *optional*): which answer tokens are `<|mask|>` in
            the noisy copy (the loss scores the supervised ones).
        noise_level (`torch.FloatTensor` of shape `(batch, seq_len)`, *optional*): the t of each token's block.
        label_weights (`torch.FloatTensor` of shape `(batch, seq_len)`, *optional*): per-token loss weights (1 for
            every supervised token when not given; `CloverDataCollator` weights the padding after EOS down).
        fused_lm_head (`bool`): TRL's trainers ask for per-token terms instead of logits (`CloverOutput.log_probs`):
            with labels, the objective's terms; TRL's own fused head (next-token loss) is never installed.
        logits_to_keep (`int` or `torch.LongTensor` of shape `(n,)`): if > 0, logits only for the last
            `logits_to_keep` positions; a tensor names the positions. The last layer then runs only there too
            (`CloverModel`'s `positions_to_keep`).
        """
        past_key_values = kwargs.pop("cache", None) if past_key_values is None else past_key_values
        output_router_logits = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        if labels is not None:
            if input_ids is None:
                raise ValueError("The block-diffusion loss needs input_ids (it masks tokens), not inputs_embeds.")
            if block_ids is None and (position_ids is not None or "cu_seq_lens_q" in kwargs):
                raise ValueError(
                    "A packed (padding-free) batch: Clover lays each answer out in blocks after its own prompt, which "
                    "position_ids cannot express. Train unpacked: packing=False and padding_free=False in TRL's "
                    "SFTConfig."
                )
            if block_ids is None:  # a causal-LM batch: rebuilt in the objective's layout
                batch = batch_from_labels(input_ids, attention_mask, labels, self.config)
            elif isinstance(block_ids, torch.Tensor):
                batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
                batch |= {"block_ids": block_ids, "noise_mask": noise_mask, "noise_level": noise_level}
                batch["label_weights"] = label_weights
            else:
                raise ValueError(
                    f"block_ids ({block_ids!r}) must be a tensor (answer blocks >= 0) with labels, or None to lay the "
                    "answers out from the labels."
                )
            return self._diffusion_loss(batch, output_router_logits, fused_lm_head)
        if fused_lm_head:
            raise ValueError("fused_lm_head=True returns the training objective's terms: pass labels.")
        positions_to_keep = None
        if isinstance(logits_to_keep, torch.Tensor):
            positions_to_keep = logits_to_keep
        elif logits_to_keep:
            inputs = input_ids if input_ids is not None else inputs_embeds
            seq_len = inputs.shape[1]
            positions_to_keep = torch.arange(max(seq_len - logits_to_keep, 0), seq_len, device=inputs.device)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            block_ids=block_ids,
            commit_length=commit_length,
            output_router_logits=output_router_logits,
            positions_to_keep=positions_to_keep,
        )
        return CloverOutput(
            logits=self.lm_head(outputs.last_hidden_state),
            cache=outputs.cache,
            router_logits=outputs.router_logits,
        )

    def _diffusion_loss(self, batch: dict, with_aux: bool, fused: bool) -> CloverOutput:
        """The training objective (docs/DESIGN.md §7): CE on the masked supervised tokens weighted 1/t (and by
        `label_weights`), over the (weighted) number of supervised tokens; plus `causal_loss_weight` times the
        causal next-token CE, and `causal_distill_weight` times the KL divergence from the causal path's next-token
        distribution to the block-diffusion prediction of each masked token (weighted as its CE). Each token's share
        of that sum is kept (`contribution`), so TRL's fused-head loss, `-log_probs.sum() / label_mask.sum()`, is
        this loss exactly."""
        input_ids, attention_mask, labels, block_ids = (batch[k] for k in ("input_ids", "attention_mask", "labels", "block_ids"))  # fmt: skip
        supervised = labels != -100
        noise_mask, noise_level = batch.get("noise_mask"), batch.get("noise_level")
        if noise_mask is None or noise_level is None:
            noise_mask, noise_level = draw_block_noise(supervised, block_ids, self.config.block_size)
        label_weights = batch.get("label_weights")
        label_weights = supervised.float() if label_weights is None else label_weights.masked_fill(~supervised, 0)
        noisy = torch.where(noise_mask, torch.full_like(input_ids, self.config.mask_token_id), input_ids)
        answer_start = int((block_ids >= 0).any(dim=0).float().argmax())
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            block_ids=block_ids,
            noisy_input_ids=noisy[:, answer_start:],
            use_cache=False,
            output_router_logits=with_aux,
        )
        noisy_hidden = outputs.last_hidden_state[:, input_ids.shape[1] :]  # (batch, answer_len, hidden)
        scored = (noise_mask & supervised)[:, answer_start:]  # masked in the noisy copy, and supervised
        logits = self.lm_head(noisy_hidden[scored]).float()  # (num_scored, vocab): only where the loss looks
        targets = labels[:, answer_start:][scored]
        # 1/t turns the masked-token CE into the ELBO weight; dividing by all supervised tokens (weighted) keeps the
        # scale independent of how many happened to be masked.
        weights = label_weights[:, answer_start:][scored] / noise_level[:, answer_start:][scored]
        total_weight = label_weights.sum().clamp(min=1e-6)
        contribution = torch.zeros(labels.shape, device=logits.device)  # (batch, seq): each token's share
        contribution[:, answer_start:][scored] = F.cross_entropy(logits, targets, reduction="none") * weights
        if self.config.causal_loss_weight or self.config.causal_distill_weight:
            causal, causal_logits = self._causal_contribution(input_ids, attention_mask, labels, label_weights)
        if self.config.causal_loss_weight:
            contribution = contribution + self.config.causal_loss_weight * total_weight * causal
        if self.config.causal_distill_weight:
            # One causal row per supervised token after the first column, in order; the scored tokens are among
            # them (answers follow a prompt), so picking the scored ones keeps the order of `logits`.
            teacher_rows = (noise_mask & supervised)[:, 1:][labels[:, 1:] != -100]
            teacher = causal_logits[teacher_rows].detach().float().log_softmax(-1)
            divergence = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
            contribution[:, answer_start:][scored] += self.config.causal_distill_weight * divergence * weights
        loss = contribution.sum() / total_weight
        aux_loss = None
        if with_aux:
            aux_loss = load_balancing_loss(outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok)  # fmt: skip
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        fused_terms = {}
        if fused:
            with torch.no_grad():  # metrics only
                probs = logits.softmax(-1)
                entropy, is_top1 = torch.zeros_like(contribution), torch.zeros_like(contribution)
                entropy[:, answer_start:][scored] = -(probs * probs.clamp(min=1e-30).log()).sum(-1) * weights
                is_top1[:, answer_start:][scored] = (logits.argmax(-1) == targets).float() * weights
            fused_terms = {"log_probs": -contribution, "label_mask": label_weights, "entropy": entropy, "is_top1": is_top1}  # fmt: skip
        # Every field given here, not set afterwards: a ModelOutput rebuilt from its items (accelerate's output
        # conversion) keeps only what the constructor saw.
        return CloverOutput(
            loss=loss, logits=logits, aux_loss=aux_loss, router_logits=outputs.router_logits, **fused_terms
        )

    def _causal_contribution(
        self, input_ids, attention_mask, labels, label_weights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token CE of the supervised tokens in a causal forward of the clean sequence (no block_ids: the
        autoregressive base's forward), weighted like the diffusion loss, each token's share of its mean
        (batch, seq; the CE of token j sits at j): it keeps a converted base's AR ability. Also returns the logits
        (one row per supervised token after the first column, in order)."""
        hidden_states = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        targets, weights = labels[:, 1:], label_weights[:, 1:]
        scored = targets != -100
        logits = self.lm_head(hidden_states[:, :-1][scored])  # (num_supervised, vocab)
        token_loss = F.cross_entropy(logits.float(), targets[scored], reduction="none")
        share = torch.zeros(labels.shape, device=token_loss.device)
        share[:, 1:][scored] = token_loss * weights[scored] / weights[scored].sum().clamp(min=1e-6)
        return share, logits


def draw_block_noise(
    supervised: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, block) a noise level t ~ U(eps, 1); each supervised token of the block is masked with probability
    t. Returns: noise_mask bool (batch, seq), noise_level float (batch, seq) (the t of each token's block, 1 outside).
    """
    batch_size, seq_len = block_ids.shape
    device = block_ids.device
    num_blocks = max(int(block_ids.max()) + 1 if block_ids.numel() else 0, 1)
    t = eps + (1 - eps) * torch.rand(batch_size, num_blocks, generator=generator, device="cpu").to(device)
    in_block = block_ids >= 0
    level = torch.where(in_block, t.gather(1, block_ids.clamp(min=0)), torch.ones_like(t[:, :1]))
    draws = torch.rand(batch_size, seq_len, generator=generator, device="cpu").to(device)
    return (draws < level) & supervised & in_block, level


def block_diffusion_layout(
    examples: list[tuple[list[int], list[int]]], pad_token_id: int, block_size: int, tail: str = "pad"
) -> dict[str, torch.Tensor]:
    """The objective's batch layout for (prompt_ids, answer_ids) examples: prompts left-padded so that every answer
    starts at the same column, answers in blocks of `block_size` from their first token, right-padded to whole blocks:

        input_ids     [pad pad p p p | a a a a  a a eos pad | ...]
        block_ids     [ -1  -1 -1 -1 -1 |  0 0 0 0  1 1  1   1 | ...]
        labels        [-100 ...          |  a a a a  a a eos pad]   the tail after the answer, to its block end
        label_weights [0 ...             |  1 1 1 1  1 1  1  1/n]   ... is pad, the whole tail counting as one token

    With `tail="mask"` the tail is left unsupervised (and `tail_mask` says where it is, for the noisy copy).
    Returns input_ids, attention_mask, labels, label_weights (float), block_ids and tail_mask (bool), each
    (batch, prompt_len + answer_len)."""
    prompt_len = max(len(prompt) for prompt, _ in examples)
    num_blocks = max(-(-len(answer) // block_size) for _, answer in examples)
    shape = (len(examples), prompt_len + num_blocks * block_size)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    label_weights = torch.zeros(shape)
    tail_mask = torch.zeros(shape, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(examples):
        answer_end = prompt_len + len(answer)
        block_end = prompt_len + -(-len(answer) // block_size) * block_size  # the end of the answer's last block
        input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.as_tensor(prompt)
        input_ids[row, prompt_len:answer_end] = torch.as_tensor(answer)
        attention_mask[row, prompt_len - len(prompt) :] = 1
        labels[row, prompt_len:answer_end] = input_ids[row, prompt_len:answer_end]
        label_weights[row, prompt_len:answer_end] = 1.0
        if block_end > answer_end and tail == "pad":
            labels[row, answer_end:block_end] = pad_token_id
            label_weights[row, answer_end:block_end] = 1.0 / (block_end - answer_end)
        elif block_end > answer_end:
            tail_mask[row, answer_end:block_end] = True
    block_ids = torch.full(shape, -1, dtype=torch.long)
    block_ids[:, prompt_len:] = torch.arange(shape[1] - prompt_len) // block_size
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "label_weights": label_weights,
        "block_ids": block_ids,
        "tail_mask": tail_mask,
    }


def example_block_noise(
    layout: dict[str, torch.Tensor],
    answer_lengths: list[int],
    block_size: int,
    generators: list[torch.Generator | None],
    eps: float = 1e-3,
    draw=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_block_noise` (or `draw`, a function of the same arguments) for each row of a `block_diffusion_layout`
    over its own answer blocks, from its own generator: the same draws whatever the padding of the batch around it
    (columns past the row's last block stay unmasked, at level 1)."""
    draw = draw or draw_block_noise
    supervised, block_ids = layout["labels"] != -100, layout["block_ids"]
    prompt_len = int((block_ids < 0).sum(-1).max())
    noise_mask, noise_level = torch.zeros_like(supervised), torch.ones(supervised.shape)
    for row, (length, generator) in enumerate(zip(answer_lengths, generators, strict=True)):
        span = slice(prompt_len, prompt_len + -(-length // block_size) * block_size)
        mask, level = draw(supervised[row : row + 1, span], block_ids[row : row + 1, span], block_size, generator, eps)
        noise_mask[row, span], noise_level[row, span] = mask[0], level[0]
    return noise_mask, noise_level


def examples_from_labels(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor
) -> list[tuple[list[int], list[int]]]:
    """The (prompt_ids, answer_ids) examples of a causal-LM batch: one per run of supervised labels (labels != -100,
    aligned with input_ids) in a row, its prompt every real token before the run, earlier answers included. A run
    that starts at the row's first token leaves that token to the prompt (block diffusion conditions on one)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    examples = []
    for row in range(input_ids.shape[0]):
        tokens = input_ids[row][real[row]].tolist()
        supervised = ((labels[row] != -100) & real[row])[real[row]].tolist()
        supervised[:1] = [False]
        start = None
        for column, is_supervised in enumerate([*supervised, False]):
            if is_supervised and start is None:
                start = column
            elif not is_supervised and start is not None:
                examples.append((tokens[:start], tokens[start:column]))
                start = None
    if not examples:
        raise ValueError(
            "labels supervise no token (all -100 outside the first): there is no answer to learn from. Mark the "
            "answer tokens in labels (e.g. TRL's assistant_only_loss or completion_only_loss)."
        )
    return examples


def batch_from_labels(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor, config: CloverConfig
) -> dict[str, torch.Tensor]:
    """A causal-LM batch (what Trainer-based clients such as TRL pass) as the objective's batch: the examples of
    `examples_from_labels` in `block_diffusion_layout` (tail "pad"), each example's noise drawn over its own blocks
    from a generator seeded from torch's (so `transformers.set_seed` / `torch.manual_seed` reproduce it)."""
    examples = examples_from_labels(input_ids, attention_mask, labels)
    layout = block_diffusion_layout(examples, config.pad_token_id, config.block_size)
    seeds = torch.randint(2**62, (len(examples),)).tolist()
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    layout["noise_mask"], layout["noise_level"] = example_block_noise(
        layout, [len(answer) for _, answer in examples], config.block_size, generators
    )
    del layout["tail_mask"]
    return {key: value.to(input_ids.device) for key, value in layout.items()}


def load_balancing_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss: num_experts * sum_e (fraction of tokens routed to e) * (mean prob of e)."""
    logits = torch.cat([r.float() for r in router_logits], dim=0)
    probs = torch.softmax(logits, dim=-1)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()  # (tokens, experts)
    return num_experts * (chosen.mean(0) / top_k * probs.mean(0)).sum()


__all__ = [
    "CloverCache",
    "CloverForBlockDiffusion",
    "CloverModel",
    "CloverPreTrainedModel",
    "block_causal_mask",
    "chunk_gated_delta_rule",
    "batch_from_labels",
    "block_diffusion_layout",
    "draw_block_noise",
    "example_block_noise",
    "examples_from_labels",
]


# save_pretrained copies the code files and writes auto_map, so every checkpoint loads with trust_remote_code.
CloverModel._auto_class = "AutoModel"
CloverForBlockDiffusion._auto_class = "AutoModelForCausalLM"
