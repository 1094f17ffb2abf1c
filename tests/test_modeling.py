"""Tests of the Clover model: parity with transformers' Qwen3.5-MoE, block-causal semantics, the committed cache,
padding, the training loss and the gated delta rule. Tiny configs on CPU, a few seconds each."""

import pytest
import torch
import torch.nn.functional as F
from conftest import qwen_config_from, random_ids, spy_attention, spy_experts_kernel
from transformers import Qwen3_5MoeForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from clover.configuration_clover import CloverConfig
from clover.modeling_clover import (
    CloverCache,
    CloverForBlockDiffusion,
    block_causal_mask,
    chunk_gated_delta_rule,
    draw_block_noise,
)

BLOCK = 8
MASK_ID = 127


# ------------------------------------------------------------------------------------------------ parity


@pytest.fixture(scope="module")
def reference_qwen(tiny_config):
    """A tiny random transformers Qwen3.5-MoE (eager attention and experts), its norms and dt_bias randomised so
    that a wrong norm convention or a missing dt_bias changes the logits."""
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(qwen_config_from(tiny_config())).float().eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    input_ids = random_ids(2, 150)  # longer than one 64-token GDN chunk
    with torch.no_grad():
        logits = model(input_ids).logits
    return model.state_dict(), input_ids, logits


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logits_match_transformers_qwen3_5_moe(
    reference_qwen, tiny_config, attn_implementation, experts_implementation, monkeypatch
):
    state_dict, input_ids, expected = reference_qwen
    if experts_implementation not in ["eager", *ALL_EXPERTS_FUNCTIONS]:
        pytest.skip(f"this transformers has no {experts_implementation} experts")
    model = CloverForBlockDiffusion(tiny_config()).float().eval()
    model.load_state_dict(state_dict, strict=True)
    model.set_attn_implementation(attn_implementation)
    try:
        model.set_experts_implementation(experts_implementation)
    except (ValueError, ImportError) as error:
        pytest.skip(f"{experts_implementation} experts unavailable here: {error}")
    calls = spy_experts_kernel(monkeypatch, experts_implementation)
    with torch.no_grad():
        logits = model(input_ids, use_cache=False).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert experts_implementation == "eager" or len(calls) == model.config.num_hidden_layers


# ------------------------------------------------------------------------------------------------ block-causal


def _block_logits(model, input_ids, block_ids):
    with torch.no_grad():
        return model(input_ids, block_ids=block_ids, use_cache=False).logits


def test_block_logits_ignore_later_blocks_and_see_their_own_block_and_context(tiny_model):
    context, num_blocks = 5, 3
    input_ids = random_ids(1, context + num_blocks * BLOCK)
    block_ids = torch.tensor([[-1] * context + [k for k in range(num_blocks) for _ in range(BLOCK)]])
    block1 = slice(context + BLOCK, context + 2 * BLOCK)
    base = _block_logits(tiny_model, input_ids, block_ids)

    later = input_ids.clone()
    later[0, context + 2 * BLOCK :] = random_ids(BLOCK, seed=1)  # every token of block 2
    changed = _block_logits(tiny_model, later, block_ids)
    torch.testing.assert_close(changed[:, : block1.stop], base[:, : block1.stop], atol=1e-5, rtol=0)

    same_block = input_ids.clone()
    same_block[0, block1.stop - 1] = (input_ids[0, block1.stop - 1] % 120) + 2  # last token of block 1
    # the first token of block 1 sees the last one (bidirectional inside the block)
    assert (
        _block_logits(tiny_model, same_block, block_ids)[0, block1.start] - base[0, block1.start]
    ).abs().max() > 1e-3

    in_context = input_ids.clone()
    in_context[0, 1] = (input_ids[0, 1] % 120) + 2
    assert (_block_logits(tiny_model, in_context, block_ids)[0, block1] - base[0, block1]).abs().max() > 1e-3


def test_without_block_ids_a_token_does_not_see_the_rest_of_its_block(tiny_model):
    input_ids = random_ids(1, 12)
    changed = input_ids.clone()
    changed[0, -1] = (input_ids[0, -1] % 120) + 2
    with torch.no_grad():
        base, after = tiny_model(input_ids, use_cache=False).logits, tiny_model(changed, use_cache=False).logits
    torch.testing.assert_close(after[:, :-1], base[:, :-1], atol=1e-5, rtol=0)


def test_block_causal_mask_matches_its_docstring_diagram():
    # Context C, block 0 = (a b), block 1 = (c d): the diagram of block_causal_mask's docstring.
    mask = block_causal_mask(torch.tensor([[-1, 0, 0, 1, 1]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # C: itself
            [1, 1, 1, 0, 0],  # a: context + block 0
            [1, 1, 1, 0, 0],  # b
            [1, 1, 1, 1, 1],  # c: everything before + block 1
            [1, 1, 1, 1, 1],  # d
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_block_causal_mask_shows_committed_keys_and_hides_padding():
    # Two committed keys (P0 padding, P1 real), then block 0 = (a b): both queries see P1 and all of block 0.
    mask = block_causal_mask(torch.tensor([[0, 0]]), key_padding_mask=torch.tensor([[0, 1, 1, 1]]), past_length=2)
    assert torch.equal(mask[0, 0], torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool))


# ------------------------------------------------------------------------------------------------ cache


@pytest.fixture
def padded_batch():
    """Prompt of 6 (row 1 left-padded by 2, with a non-pad id under the padding so leaks would show) + 3 blocks."""
    prompt_len, num_blocks = 6, 3
    input_ids = random_ids(2, prompt_len + num_blocks * BLOCK, seed=2)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    block_ids = torch.tensor([-1] * prompt_len + [k for k in range(num_blocks) for _ in range(BLOCK)]).expand(2, -1)
    return input_ids, attention_mask, block_ids, prompt_len


def _prefill(model, input_ids, attention_mask, prompt_len):
    cache = CloverCache(model.config)
    with torch.no_grad():
        logits = model(
            input_ids[:, :prompt_len], attention_mask=attention_mask[:, :prompt_len], past_key_values=cache,
            use_cache=True,
        ).logits  # fmt: skip
    return cache, logits


def _forward_block(model, cache, block, attention_mask, end, use_cache, commit_length=None, block_ids=None):
    with torch.no_grad():
        return model(
            block, attention_mask=attention_mask[:, :end], past_key_values=cache, use_cache=use_cache,
            block_ids=torch.zeros_like(block) if block_ids is None else block_ids, commit_length=commit_length,
        ).logits  # fmt: skip


def test_committing_blocks_one_at_a_time_equals_a_whole_sequence_forward(tiny_model, padded_batch):
    input_ids, attention_mask, block_ids, prompt_len = padded_batch
    with torch.no_grad():
        expected = tiny_model(input_ids, attention_mask=attention_mask, block_ids=block_ids, use_cache=False).logits
    cache, prompt_logits = _prefill(tiny_model, input_ids, attention_mask, prompt_len)
    pieces = [prompt_logits]
    for start in range(prompt_len, input_ids.shape[1], BLOCK):
        end = start + BLOCK
        pieces.append(_forward_block(tiny_model, cache, input_ids[:, start:end], attention_mask, end, use_cache=True))
    assert cache.get_seq_length() == input_ids.shape[1]
    real = attention_mask.bool()  # padding outputs are discarded
    torch.testing.assert_close(torch.cat(pieces, dim=1)[real], expected[real], atol=1e-4, rtol=1e-4)


def test_denoising_forward_leaves_the_cache_bit_identical(tiny_model, padded_batch):
    input_ids, attention_mask, _, prompt_len = padded_batch
    cache, _ = _prefill(tiny_model, input_ids, attention_mask, prompt_len)
    end = prompt_len + BLOCK
    _forward_block(tiny_model, cache, input_ids[:, prompt_len:end], attention_mask, end, use_cache=True)
    before = [t.clone() for t in cache.tensors()]
    assert len(before) == 3 * 2 + 2  # 3 GDN layers (conv window, state) + 1 attention layer (keys, values)

    canvas = torch.full((2, BLOCK), MASK_ID)
    canvas[:, 2] = 9
    _forward_block(tiny_model, cache, canvas, attention_mask, end + BLOCK, use_cache=False)
    after = cache.tensors()
    assert cache.get_seq_length() == end
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_single_block_without_padding_attends_without_a_mask_and_gives_the_masked_logits(
    tiny_model, attn_implementation, monkeypatch
):
    tiny_model.config._attn_implementation = attn_implementation
    input_ids = random_ids(2, 10 + BLOCK, seed=4)
    attention_mask = torch.ones_like(input_ids)
    cache, _ = _prefill(tiny_model, input_ids, attention_mask, 10)
    canvas = input_ids[:, 10:].clone()
    canvas[:, ::3] = MASK_ID
    masked = _forward_block(tiny_model, cache, canvas, attention_mask, 10 + BLOCK, use_cache=False)

    calls = spy_attention(monkeypatch, attn_implementation)
    with torch.no_grad():
        unmasked = tiny_model(canvas, past_key_values=cache, block_ids=0, use_cache=False).logits
    masks_seen = [mask for _, _, mask in calls]
    assert masks_seen and all(mask is None for mask in masks_seen)
    torch.testing.assert_close(unmasked, masked, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="got -1, use >= 0"):
        tiny_model(canvas, past_key_values=cache, block_ids=-1, use_cache=False)


def test_fused_commit_and_denoise_equals_commit_then_denoise(tiny_model, padded_batch):
    input_ids, attention_mask, _, prompt_len = padded_batch
    committed = input_ids[:, prompt_len : prompt_len + BLOCK]
    canvas = torch.full((2, BLOCK), MASK_ID)
    canvas[:, 3] = 17
    end = prompt_len + 2 * BLOCK
    cache, _ = _prefill(tiny_model, input_ids, attention_mask, prompt_len)
    fused_cache = cache.copy()

    commit_logits = _forward_block(tiny_model, cache, committed, attention_mask, end - BLOCK, use_cache=True)
    denoise_logits = _forward_block(tiny_model, cache, canvas, attention_mask, end, use_cache=False)

    both = torch.cat([committed, canvas], dim=1)
    block_ids = torch.tensor([0] * BLOCK + [1] * BLOCK).expand(2, -1)
    fused_logits = _forward_block(
        tiny_model, fused_cache, both, attention_mask, end, use_cache=False, commit_length=BLOCK, block_ids=block_ids
    )
    torch.testing.assert_close(fused_logits, torch.cat([commit_logits, denoise_logits], dim=1), atol=1e-5, rtol=1e-5)
    assert fused_cache.get_seq_length() == cache.get_seq_length() == prompt_len + BLOCK
    for fused, separate in zip(fused_cache.tensors(), cache.tensors(), strict=True):
        torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("keep", [None, [BLOCK + 1, 2 * BLOCK - 1], [2, BLOCK + 1]])
def test_a_finished_block_and_a_canvas_without_padding_attend_without_a_mask(
    tiny_model, attn_implementation, keep, monkeypatch
):
    """The fused commit-and-denoise forward of an unpadded batch: an int block_ids makes it blocks 0 and 1, which
    attend block by block with no mask (the last layer too when it keeps only canvas columns) and give the logits,
    states and cache of the masked forward."""
    tiny_model.config._attn_implementation = attn_implementation
    input_ids = random_ids(2, 10 + BLOCK, seed=5)
    attention_mask = torch.ones(2, 10 + 2 * BLOCK, dtype=torch.long)
    cache, _ = _prefill(tiny_model, input_ids, attention_mask, 10)
    masked_cache = cache.copy()
    both = torch.cat([input_ids[:, 10:], torch.full((2, BLOCK), MASK_ID)], dim=1)
    both[:, BLOCK + 2] = 17
    keep = None if keep is None else torch.tensor(keep)
    block_ids = torch.tensor([0] * BLOCK + [1] * BLOCK).expand(2, -1)
    with torch.no_grad():
        masked = tiny_model.model(
            both, attention_mask=attention_mask, past_key_values=masked_cache, block_ids=block_ids,
            commit_length=BLOCK, positions_to_keep=keep,
        ).last_hidden_state  # fmt: skip

    calls = spy_attention(monkeypatch, attn_implementation)
    with torch.no_grad():
        unmasked = tiny_model.model(
            both, past_key_values=cache, block_ids=0, commit_length=BLOCK, positions_to_keep=keep
        ).last_hidden_state
    torch.testing.assert_close(unmasked, masked, atol=1e-5, rtol=1e-5)
    masks_seen = [mask for _, _, mask in calls]
    # The tiny model's one attention layer is its last: one unmasked call per block, one over the kept canvas
    # columns, and the materialized mask's rows when a kept column lies in the finished block.
    if keep is None:
        assert masks_seen == [None, None]
    elif int(keep.min()) >= BLOCK:
        assert masks_seen == [None]
    else:
        assert len(masks_seen) == 1 and masks_seen[0].shape[-2:] == (len(keep), 10 + 2 * BLOCK)
    for a, b in zip(cache.tensors(), masked_cache.tensors(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("last_layer", ["full_attention", "linear_attention"])
@pytest.mark.parametrize("keep", [[BLOCK + 1, BLOCK + 3, 2 * BLOCK - 1], []])
def test_positions_to_keep_gives_those_columns_and_fills_the_cache_alike(tiny_config, padded_batch, last_layer, keep):
    """The last layer runs only at the kept columns (none: a forward that only commits), every column still enters
    the cache, and the kept columns' states are the full forward's."""
    config = tiny_config(layer_types=["linear_attention", "full_attention", "linear_attention", last_layer])
    model = CloverForBlockDiffusion(config).eval()
    input_ids, attention_mask, _, prompt_len = padded_batch
    end = prompt_len + 2 * BLOCK
    both = input_ids[:, prompt_len:end].clone()
    both[:, BLOCK + 1 :: 2] = MASK_ID
    block_ids = torch.tensor([0] * BLOCK + [1] * BLOCK).expand(2, -1)
    cache, _ = _prefill(model, input_ids, attention_mask, prompt_len)
    pruned_cache = cache.copy()
    keep = torch.tensor(keep, dtype=torch.long)

    def forward(cache, positions_to_keep):
        with torch.no_grad():
            return model.model(
                both, attention_mask=attention_mask[:, :end], past_key_values=cache, block_ids=block_ids,
                commit_length=BLOCK, positions_to_keep=positions_to_keep,
            ).last_hidden_state  # fmt: skip

    full, pruned = forward(cache, None), forward(pruned_cache, keep)
    assert pruned.shape == (2, len(keep), config.hidden_size)
    torch.testing.assert_close(pruned, full[:, keep], atol=1e-5, rtol=1e-5)
    assert pruned_cache.get_seq_length() == cache.get_seq_length() == prompt_len + BLOCK
    for a, b in zip(pruned_cache.tensors(), cache.tensors(), strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # logits_to_keep runs the same pruned last layer
        logits = model(input_ids, attention_mask=attention_mask, logits_to_keep=3).logits
        expected = model(input_ids, attention_mask=attention_mask).logits[:, -3:]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_left_padding_stays_out_of_the_gdn_scan_and_conv_window(tiny_model):
    row = random_ids(1, 10, seed=3)
    other = random_ids(1, 14, seed=4)
    # Non-pad ids under the padding: a leak into the conv window or state would change row 0's logits.
    padded = torch.cat([torch.cat([torch.full((1, 4), 55), row], dim=1), other])
    attention_mask = torch.ones_like(padded)
    attention_mask[0, :4] = 0
    with torch.no_grad():
        alone = tiny_model(row, use_cache=False).logits
        batched = tiny_model(padded, attention_mask=attention_mask, use_cache=False).logits
    torch.testing.assert_close(batched[:1, 4:], alone, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ training loss


@pytest.fixture
def training_batch():
    """Prompt of 6 (row 1 left-padded), 2 answer blocks; row 0's last 3 answer tokens unsupervised (right pad)."""
    prompt_len, answer_len = 6, 2 * BLOCK
    input_ids = random_ids(2, prompt_len + answer_len, seed=5)
    input_ids[0, -3:] = 0
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    labels = input_ids.clone()
    labels[:, :prompt_len] = -100
    labels[0, -3:] = -100
    block_ids = torch.tensor([-1] * prompt_len + [0] * BLOCK + [1] * BLOCK).expand(2, -1)
    noise_mask, noise_level = draw_block_noise(
        labels != -100, block_ids, BLOCK, generator=torch.Generator().manual_seed(0)
    )
    assert noise_mask.sum() >= 4
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, labels=labels, block_ids=block_ids,
        noise_mask=noise_mask, noise_level=noise_level,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")  # renamed in transformers 5.24
def test_gradient_checkpointing_gives_the_same_loss_and_grads(tiny_model, training_batch):
    tiny_model.train()
    loss = tiny_model(**training_batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in tiny_model.named_parameters() if p.grad is not None}
    tiny_model.zero_grad()

    tiny_model.gradient_checkpointing_enable()
    calls = []
    for layer in tiny_model.model.layers:  # count the checkpointed layer calls: the flag alone proves nothing
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=checkpoint, **k: calls.append(1) or _f(*a, **k)
    checkpointed = tiny_model(**training_batch).loss
    checkpointed.backward()
    assert len(calls) == len(tiny_model.model.layers)
    torch.testing.assert_close(checkpointed, loss)
    assert len(grads) > 0 and set(grads) == {n for n, p in tiny_model.named_parameters() if p.grad is not None}
    for name, param in tiny_model.named_parameters():
        if name in grads:
            torch.testing.assert_close(param.grad, grads[name], atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------ gated delta rule


def naive_gated_delta_rule(query, key, value, g, beta, initial_state):
    """Token by token: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q. Also the state before each
    token. Inputs (batch, seq, heads, dim); state (batch, heads, k_dim, v_dim)."""
    state = initial_state.clone()
    outputs, states = [], []
    for t in range(query.shape[1]):
        states.append(state)
        q, k, v = query[:, t], key[:, t], value[:, t]  # (batch, heads, dim)
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
        state = state + k[..., :, None] * u[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q))
    return torch.stack(outputs, dim=1), state, states


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_gated_delta_rule_equals_the_token_recurrence(chunk_size):
    generator = torch.Generator().manual_seed(0)
    batch, seq_len, heads, k_dim, v_dim = 2, 70, 3, 8, 6  # 70: not a multiple of either chunk size

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    query = F.normalize(randn(batch, seq_len, heads, k_dim), dim=-1) * k_dim**-0.5
    key = F.normalize(randn(batch, seq_len, heads, k_dim), dim=-1)
    value = randn(batch, seq_len, heads, v_dim)
    g = -0.3 * torch.rand(batch, seq_len, heads, generator=generator)  # log decay <= 0
    beta = torch.rand(batch, seq_len, heads, generator=generator)
    initial_state = randn(batch, heads, k_dim, v_dim)

    output, state, chunk_states = chunk_gated_delta_rule(
        query, key, value, g, beta, initial_state, chunk_size=chunk_size, output_chunk_states=True
    )
    expected_output, expected_state, states = naive_gated_delta_rule(query, key, value, g, beta, initial_state)
    torch.testing.assert_close(output, expected_output, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)
    expected_chunk_states = torch.stack(states[::chunk_size], dim=2)  # the state at each chunk start
    assert chunk_states.shape == (batch, heads, -(-seq_len // chunk_size), k_dim, v_dim)
    torch.testing.assert_close(chunk_states, expected_chunk_states, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
        (dict(layer_types=["linear_attention"] * 3 + ["not_a_layer"]), "layer_types"),
        (dict(num_attention_heads=3), "num_attention_heads"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(mask_token_id=128), "mask_token_id"),
        (dict(mask_token_id=-1), "mask_token_id"),
        (dict(block_size=0), "block_size"),
    ],
    ids=[
        "layer_types_too_short",
        "unsupported_layer_type",
        "unknown_layer_type",
        "heads_not_divisible",
        "linear_heads_not_divisible",
        "mask_id_past_vocab",
        "negative_mask_id",
        "zero_block_size",
    ],  # fmt: skip
)
def test_invalid_config_raises_value_error_naming_the_field(tiny_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_default_config_is_valid_and_describes_clover_35b():
    config = CloverConfig()
    assert (config.block_size, config.mask_token_id, config.num_hidden_layers) == (32, 248077, 40)
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("bad_id", [128, -1])
def test_input_ids_outside_the_vocabulary_raise_value_error(tiny_model, bad_id):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_model(torch.tensor([[5, 6, bad_id]]), use_cache=False)
