"""The committed cache of Clover's block-diffusion decoding (docs/DESIGN.md §5)."""

from __future__ import annotations

import torch

from .configuration_clover import CloverConfig


class CloverCache:
    """The committed state of a batch of sequences: attention keys/values per full-attention layer, conv window and
    recurrent state per Gated DeltaNet layer.

    A forward reads it and appends only its first `commit_length` tokens, so denoising forwards (commit_length 0)
    leave it untouched and a block enters it once, when committed. GDN states cannot be cropped: to go back, copy
    the cache first (`CloverCache.copy`).

    `length` is the number of committed tokens (padding included). A static cache (`static=True`, with `max_length`)
    never changes a tensor's shape or identity once allocated: attention reads the whole `max_length` buffer under a
    mask, `length` is a 0-d tensor advanced in place, and the GDN states are updated in place. That is what lets
    `torch.compile` trace a decoding step once and replay it for every step and block.
    """

    is_compileable = False

    def __init__(
        self,
        config: CloverConfig,
        max_length: int | None = None,
        static: bool = False,
        device: torch.device | str | None = None,
    ):
        """`max_length`: allocate the attention buffers for this many tokens up front (no re-allocation while
        decoding). `static` (needs `max_length`): see the class docstring; `device` holds its `length` tensor."""
        if static and not max_length:
            raise ValueError("A static CloverCache needs max_length: the number of tokens it will ever hold.")
        self.max_length = max_length or 0
        self.static = static
        self.layer_types = list(config.layer_types)
        self.conv_kernel_size = config.linear_conv_kernel_dim
        num_layers = len(self.layer_types)
        self.key_cache: list[torch.Tensor | None] = [None] * num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * num_layers
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers
        self.length: int | torch.Tensor = torch.zeros((), dtype=torch.long, device=device) if static else 0

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Number of committed tokens (padding included); a host sync for a static cache."""
        return int(self.length)

    def attention_kv(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes a forward's keys/values (batch, kv_heads, new, head_dim) right after the committed ones and returns
        views over committed + new (a static cache: the whole buffer). Nothing is committed here: `advance` moves
        the committed length, so keys past it are scratch that the next forward overwrites. The buffers grow
        geometrically, so a step never copies the whole cache."""
        if self.static:
            if self.key_cache[layer_idx] is None:  # zeros: masked keys must not hold NaN garbage (0 * NaN = NaN)
                shape = (*key.shape[:2], self.max_length, key.shape[3])
                self.key_cache[layer_idx], self.value_cache[layer_idx] = key.new_zeros(shape), value.new_zeros(shape)
            index = self.length + torch.arange(key.shape[2], device=key.device)
            self.key_cache[layer_idx].index_copy_(2, index, key)
            self.value_cache[layer_idx].index_copy_(2, index, value)
            return self.key_cache[layer_idx], self.value_cache[layer_idx]

        length, new = self.length, key.shape[2]
        buffer = self.key_cache[layer_idx]
        if buffer is None or buffer.shape[2] < length + new:
            capacity = max(length + new, 2 * (buffer.shape[2] if buffer is not None else 0), 256, self.max_length)
            for store in (self.key_cache, self.value_cache):
                old = store[layer_idx]
                grown = key.new_empty(*key.shape[:2], capacity, key.shape[3])
                if old is not None:
                    grown[:, :, :length] = old[:, :, :length]
                store[layer_idx] = grown
        self.key_cache[layer_idx][:, :, length : length + new] = key
        self.value_cache[layer_idx][:, :, length : length + new] = value
        return self.key_cache[layer_idx][:, :, : length + new], self.value_cache[layer_idx][:, :, : length + new]

    def update_linear(self, layer_idx: int, conv_inputs: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """conv_inputs (batch, channels, new): the pre-conv inputs just committed; keeps the last kernel - 1."""
        window = self.conv_states[layer_idx]
        if window is None:
            window = conv_inputs.new_zeros(*conv_inputs.shape[:2], self.conv_kernel_size - 1)
        kept = torch.cat([window, conv_inputs], dim=-1)[:, :, -(self.conv_kernel_size - 1) :]
        if self.static and self.conv_states[layer_idx] is not None:
            self.conv_states[layer_idx].copy_(kept)
            self.recurrent_states[layer_idx].copy_(recurrent_state)
            return
        self.conv_states[layer_idx] = kept.clone()  # a view would keep every committed input of the layer alive
        self.recurrent_states[layer_idx] = recurrent_state.clone() if self.static else recurrent_state

    def advance(self, num_tokens: int) -> None:
        """Moves the committed length past the first `num_tokens` tokens of the forward that just ran."""
        if self.static:
            self.length.add_(num_tokens)  # in place: a compiled step neither reads nor guards on its value
        else:
            self.length += num_tokens

    def tensors(self) -> list[torch.Tensor]:
        """Every committed tensor of the cache (attention entries up to the committed length)."""
        length = self.get_seq_length()
        attention = [t[:, :, :length] for t in self.key_cache + self.value_cache if t is not None]
        return attention + [t for t in self.conv_states + self.recurrent_states if t is not None]

    def copy(self) -> CloverCache:
        new = CloverCache.__new__(CloverCache)
        new.__dict__.update(self.__dict__)
        for name in ("key_cache", "value_cache", "conv_states", "recurrent_states"):
            setattr(new, name, [None if t is None else t.clone() for t in getattr(self, name)])
        if self.static:
            new.length = self.length.clone()
        return new

    def snapshot(self) -> tuple:
        """What `restore` needs to undo later commits of a dynamic cache: the committed length and the GDN states.
        Cheap: a commit replaces the GDN tensors rather than writing into them, and attention keys past the length
        are scratch."""
        if self.static:
            raise ValueError("A static cache updates its states in place: copy it (`CloverCache.copy`) to go back.")
        return self.length, list(self.conv_states), list(self.recurrent_states)

    def restore(self, snapshot: tuple) -> None:
        """Goes back to a `snapshot` of this cache (taken since no rows were dropped)."""
        self.length, conv_states, recurrent_states = snapshot
        self.conv_states, self.recurrent_states = list(conv_states), list(recurrent_states)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows (drops finished sequences)."""
        for name in ("key_cache", "value_cache", "conv_states", "recurrent_states"):
            setattr(self, name, [None if t is None else t[rows.to(t.device)] for t in getattr(self, name)])

    def __len__(self) -> int:
        return len(self.layer_types)


__all__ = ["CloverCache"]
