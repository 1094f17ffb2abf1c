"""Tests of block-diffusion `generate`: against a naive no-cache decoder and batch-size-1 runs, the LowConfidence
helpers on hand-built logits, the output format, streaming, the generation config and bad input. Tiny model, CPU."""

import math

import pytest
import torch
from conftest import qwen_config_from, random_ids, spy_attention
from transformers import LogitsProcessorList, Qwen3_5MoeForCausalLM, TopKLogitsWarper

from clover.generation_clover import (
    CloverGenerationConfig,
    CloverGenerationOutput,
    _Decoding,
    candidates_and_confidence,
    min_commits_per_step,
    select_positions_to_commit,
)
from clover.modeling_clover import CloverCache, CloverForBlockDiffusion

BLOCK, MASK_ID, PAD_ID, EOS_ID = 8, 127, 0, 126
MAX_NEW_TOKENS = 30  # 3 whole blocks of 8 and a partial one of 6
LOGIT_SCALE = 20.0  # spreads the tiny model's probabilities: some steps reach 0.3 at several positions, not all


@pytest.fixture
def model(tiny_model):
    """The tiny model with confident, spread predictions, and EOS (logit 0 among logits of +-20) never chosen."""
    with torch.no_grad():
        tiny_model.lm_head.weight.mul_(LOGIT_SCALE)
        tiny_model.lm_head.weight[EOS_ID] = 0.0
    return tiny_model


def generate(model, prompt, **kwargs):
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "return_dict_in_generate": True, **kwargs}
    return model.generate(prompt, **kwargs)


# ------------------------------------------------------------------------------------------------ naive reference


def naive_decode(model, prompt, max_new_tokens, threshold, eos_id=EOS_ID):
    """The decode rule (docs/DESIGN.md §6) for one row, with no cache: every step reruns [prompt, committed blocks, canvas]
    with block_ids. Returns (the new tokens: max_new_tokens, or through EOS when it comes first; forwards)."""
    context, new_tokens, forwards = prompt[0].tolist(), [], 0
    for block in range(math.ceil(max_new_tokens / BLOCK)):
        canvas = [MASK_ID] * BLOCK  # every block is decoded whole, then the answer is cut to max_new_tokens
        while True:
            masked = [i for i in range(BLOCK) if canvas[i] == MASK_ID]
            eos_at = [i for i in range(BLOCK) if canvas[i] == eos_id]
            if not masked or (eos_at and min(masked) > eos_at[0]):  # done, or EOS with nothing masked before it
                break
            block_ids = [-1] * prompt.shape[1] + [k for k in range(block + 1) for _ in range(BLOCK)]
            with torch.no_grad():
                logits = model(
                    torch.tensor([context + canvas]), block_ids=torch.tensor([block_ids]), use_cache=False
                ).logits[0, -BLOCK:]
            forwards += 1
            logits = logits.float()
            logits[:, MASK_ID] = -math.inf
            probs = torch.softmax(logits, dim=-1)
            candidate = probs.argmax(-1).tolist()
            confidence = probs.max(-1).values.tolist()
            most_confident = max(masked, key=lambda i: confidence[i])  # first one on ties, as a stable sort
            for i in masked:
                if confidence[i] >= threshold or i == most_confident:
                    canvas[i] = candidate[i]
        if eos_id in canvas:
            new_tokens += canvas[: canvas.index(eos_id) + 1]
            break
        new_tokens += canvas
        context += canvas
    return new_tokens[:max_new_tokens], forwards


@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_generate_equals_the_naive_no_cache_decoder(model, threshold):
    prompt = random_ids(1, 6, seed=1)
    out = generate(model, prompt, threshold=threshold)
    expected, forwards = naive_decode(model, prompt, MAX_NEW_TOKENS, threshold)
    assert out.sequences[0, 6:].tolist() == expected
    assert EOS_ID not in expected and MASK_ID not in expected
    assert int(out.num_forward_passes) == forwards
    if threshold < 1.0:
        assert float(out.tokens_per_forward) > 1.0  # some step committed several tokens
        assert max(out.steps_per_block) > 1  # and some step committed only one: the threshold is really in play


def test_unpadded_decoding_attends_without_a_mask_after_the_prefill(model, monkeypatch):
    """Every decoding forward of an unpadded batch (denoising steps and the fused commit-and-denoise forwards) runs
    attention with no mask: no (queries, keys) tensor per step (the tokens themselves are the naive decoder's,
    tested above)."""
    recorded = spy_attention(monkeypatch, model.config._attn_implementation)
    out = generate(model, random_ids(1, 6, seed=1), threshold=0.3)
    calls = [(queries, keys, mask is None) for queries, keys, mask in recorded]
    decoding = [call for call in calls if call[1] > 6]  # the prefill's keys are the 6 prompt tokens
    assert len(decoding) == int(out.num_forward_passes)  # the tiny model's one attention layer: one call a forward
    assert any(keys > 6 + BLOCK for _, keys, _ in decoding)  # the fused forwards ran (a block was committed)
    assert all(unmasked for _, _, unmasked in decoding)


def test_generate_equals_the_naive_decoder_when_eos_occurs(model):
    prompt = random_ids(1, 6, seed=1)
    without_eos = generate(model, prompt, threshold=0.3).sequences[0, 6:]
    eos_id = int(without_eos[10])  # a token the model commits in block 1: make it the EOS
    assert eos_id != PAD_ID
    out = generate(model, prompt, threshold=0.3, eos_token_id=eos_id)
    expected, forwards = naive_decode(model, prompt, MAX_NEW_TOKENS, 0.3, eos_id=eos_id)
    assert out.sequences[0, 6:].tolist() == expected
    assert expected.index(eos_id) <= 10 and expected[-1] == eos_id  # a lone row ends at its EOS
    assert int(out.num_forward_passes) == forwards


@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_a_shorter_budget_gives_a_prefix_of_a_longer_one(model, unequal_prompts, threshold):
    # As in autoregressive decoding: the last block is decoded whole and then cut, so the tokens never depend on
    # max_new_tokens. Budgets 5, 13, 22 and 30 end mid-block; the reference decodes 31 (4 whole blocks).
    prompts, input_ids, attention_mask = unequal_prompts
    longest = generate(model, input_ids, attention_mask=attention_mask, threshold=threshold, max_new_tokens=31)
    single = generate(model, prompts[1], threshold=threshold, max_new_tokens=31).sequences[0, 9:]
    for budget in (5, 13, 22, 30):
        batched = generate(model, input_ids, attention_mask=attention_mask, threshold=threshold, max_new_tokens=budget)
        assert batched.sequences.shape == (2, 9 + budget)
        torch.testing.assert_close(batched.sequences[:, 9:], longest.sequences[:, 9 : 9 + budget])
        alone = generate(model, prompts[1], threshold=threshold, max_new_tokens=budget).sequences[0, 9:]
        torch.testing.assert_close(alone, single[:budget])
        assert alone.tolist() == naive_decode(model, prompts[1], budget, threshold)[0]


# ------------------------------------------------------------------------------------------------ batching and counts


@pytest.fixture
def unequal_prompts():
    """Prompts of 4 and 9 tokens, left-padded into one batch."""
    short, long = random_ids(1, 4, seed=2), random_ids(1, 9, seed=3)
    input_ids = torch.cat([torch.cat([torch.full((1, 5), PAD_ID), short], dim=1), long])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    return (short, long), input_ids, attention_mask


@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_batched_generate_equals_one_by_one(model, unequal_prompts, threshold):
    prompts, input_ids, attention_mask = unequal_prompts
    batched = generate(model, input_ids, attention_mask=attention_mask, threshold=threshold)
    assert batched.sequences.shape == (2, 9 + MAX_NEW_TOKENS)
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, threshold=threshold)
        assert batched.sequences[row, 9:].tolist() == alone.sequences[0, prompt.shape[1] :].tolist()
        assert int(batched.num_forward_passes[row]) == int(alone.num_forward_passes[0])


def test_batched_generate_equals_one_by_one_when_a_row_ends_early(model, unequal_prompts):
    prompts, input_ids, attention_mask = unequal_prompts
    first_run = generate(model, input_ids, attention_mask=attention_mask, threshold=0.3).sequences
    eos_id = int(first_run[0, 9 + 9])  # a token row 0 commits in block 1: make it the EOS
    batched = generate(model, input_ids, attention_mask=attention_mask, threshold=0.3, eos_token_id=eos_id)
    assert int(batched.num_new_tokens[0]) <= 10  # row 0 ends early, in block 0 or 1
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, threshold=0.3, eos_token_id=eos_id)
        alone_tokens = alone.sequences[0, prompt.shape[1] :].tolist()  # a lone row that ended stops at its EOS
        assert batched.sequences[row, 9 : 9 + len(alone_tokens)].tolist() == alone_tokens
        assert set(batched.sequences[row, 9 + len(alone_tokens) :].tolist()) <= {PAD_ID}
        assert int(batched.num_forward_passes[row]) == int(alone.num_forward_passes[0])
        assert int(batched.num_new_tokens[row]) == int(alone.num_new_tokens[0])


def test_threshold_one_commits_one_token_per_forward(model):
    out = generate(model, random_ids(1, 6, seed=1), threshold=1.0)
    assert int(out.num_new_tokens) == MAX_NEW_TOKENS  # no EOS
    # one forward per token of every block, the last one decoded whole (32 tokens) before the cut to 30
    assert int(out.num_forward_passes) == 4 * BLOCK
    assert out.steps_per_block == [8, 8, 8, 8]


def test_unfused_commit_gives_the_same_tokens_with_one_forward_more_per_committed_block(model, unequal_prompts):
    _, input_ids, attention_mask = unequal_prompts
    fused = generate(model, input_ids, attention_mask=attention_mask, threshold=0.3)
    unfused = generate(model, input_ids, attention_mask=attention_mask, threshold=0.3, fuse_commit=False)
    assert torch.equal(fused.sequences, unfused.sequences)
    non_final_blocks = math.ceil(MAX_NEW_TOKENS / BLOCK) - 1  # the last block is never committed to the cache
    assert unfused.num_forward_passes.tolist() == (fused.num_forward_passes + non_final_blocks).tolist()


def test_max_steps_per_block_caps_the_denoising_steps(model):
    out = generate(model, random_ids(1, 6, seed=1), threshold=1.0, max_steps_per_block=2)
    # threshold 1.0 alone would take one step per token; the cap forces ceil(masked / steps_left) per step.
    assert out.steps_per_block == [2, 2, 2, 2]
    assert int(out.num_forward_passes) == 8
    assert MASK_ID not in out.sequences.tolist()[0]


# ------------------------------------------------------------------------------------------------ self-speculative


def causal_greedy(model, prompt, max_new_tokens, eos_id=EOS_ID) -> list[int]:
    """The model's own causal greedy decoding, by transformers' Qwen3_5MoeForCausalLM holding the same weights:
    the new tokens through EOS."""
    twin = Qwen3_5MoeForCausalLM(qwen_config_from(model.config)).float().eval()
    twin.load_state_dict(model.state_dict())
    out = twin.generate(
        prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=PAD_ID
    )
    tokens = out[0, prompt.shape[1] :].tolist()
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def through_eos(tokens: list[int], eos_id: int = EOS_ID) -> list[int]:
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@pytest.mark.parametrize("prompt_len,seed", [(6, 1), (1, 4), (11, 7)])
def test_self_speculative_equals_causal_greedy_decoding(model, prompt_len, seed):
    prompt = random_ids(1, prompt_len, seed=seed)
    out = generate(model, prompt, strategy="self_speculative")
    assert out.sequences.shape == (1, prompt_len + MAX_NEW_TOKENS)
    assert out.sequences[0, prompt_len:].tolist() == causal_greedy(model, prompt, MAX_NEW_TOKENS)
    # every iteration keeps at least two tokens (the draft starts with the causal next token, then the correction)
    assert int(out.num_forward_passes) <= sum(out.steps_per_block) + len(out.steps_per_block)


@pytest.mark.parametrize(
    "max_new_tokens,draft_starts",
    [(30, [0, 8, 16, 24]), (9, [0])],  # 9: the first verify has no room for another draft after it, so no fold
)
def test_self_speculative_with_drafts_always_accepted_folds_each_verify_into_the_next_draft(
    model, monkeypatch, max_new_tokens, draft_starts
):
    """A drafter that always proposes causal greedy's own tokens: each verify accepts its whole draft, commits it and
    runs the next draft's first step, so an iteration costs one forward; the output stays causal greedy's."""
    prompt = random_ids(1, 6, seed=1)
    greedy = causal_greedy(model, prompt, 64)
    assert EOS_ID not in greedy[:max_new_tokens]
    starts = []

    def oracle_draft(state, next_token, hidden_states, decoding):
        start = state.cache.get_seq_length() - prompt.shape[1]  # every token before the draft is committed
        assert int(next_token) == greedy[start]
        starts.append(start)
        return torch.tensor([greedy[start : start + BLOCK]]), 1

    monkeypatch.setattr(model, "_denoise_draft", oracle_draft)
    calls = []
    hook = model.model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    try:
        out = generate(model, prompt, strategy="self_speculative", max_new_tokens=max_new_tokens)
    finally:
        hook.remove()
    assert out.sequences[0, 6:].tolist() == greedy[:max_new_tokens]
    assert starts == draft_starts  # a folded verify keeps its draft, the bonus starting the next one
    assert int(out.num_forward_passes) == len(calls) - 1  # every forward after the prefill is counted
    # the first draft's forward, then one verify per draft: each but the last runs the next draft's first step
    assert int(out.num_forward_passes) == 1 + len(starts)


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_self_speculative_with_capped_drafts_equals_causal_greedy_decoding(model, draft_steps):
    """max_steps_per_block caps a draft's denoising steps; the verify keeps the output that of causal greedy."""
    prompt = random_ids(1, 6, seed=1)
    out = generate(model, prompt, strategy="self_speculative", max_steps_per_block=draft_steps)
    assert out.sequences[0, 6:].tolist() == causal_greedy(model, prompt, MAX_NEW_TOKENS)
    assert max(out.steps_per_block) <= draft_steps
    assert int(out.num_forward_passes) <= sum(out.steps_per_block) + len(out.steps_per_block)


def test_self_speculative_batch_of_unequal_prompts_equals_causal_greedy_per_row(model, unequal_prompts):
    prompts, input_ids, attention_mask = unequal_prompts
    out = generate(model, input_ids, attention_mask=attention_mask, strategy="self_speculative")
    for row, prompt in enumerate(prompts):
        assert out.sequences[row, 9:].tolist() == causal_greedy(model, prompt, MAX_NEW_TOKENS)
        alone = generate(model, prompt, strategy="self_speculative")
        assert int(out.num_forward_passes[row]) == int(alone.num_forward_passes[0])


def test_self_speculative_stops_at_an_early_eos_like_causal_greedy(model):
    prompt = random_ids(1, 6, seed=1)
    eos_id = causal_greedy(model, prompt, MAX_NEW_TOKENS)[3]  # a token causal greedy emits early: make it the EOS
    out = generate(model, prompt, strategy="self_speculative", eos_token_id=eos_id)
    expected = causal_greedy(model, prompt, MAX_NEW_TOKENS, eos_id=eos_id)
    assert len(expected) <= 4 and expected[-1] == eos_id
    new = out.sequences[0, 6:].tolist()
    assert new == expected  # stops at the EOS, as causal greedy decoding does
    assert int(out.num_new_tokens) == len(expected)


def test_self_speculative_counts_every_forward_after_the_prefill(model):
    prompt = random_ids(1, 6, seed=1)
    calls = []
    hook = model.model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    try:
        out = generate(model, prompt, strategy="self_speculative")
    finally:
        hook.remove()
    assert int(out.num_forward_passes) == len(calls) - 1  # one prefill forward (all but the last prompt token)
    # draft steps + one verify forward per draft (none starts with EOS here), less the drafts whose first step rode in
    # the verify before them (whole drafts accepted: rare for this random model)
    assert int(out.num_forward_passes) <= sum(out.steps_per_block) + len(out.steps_per_block)


def test_self_speculative_refuses_sampling(tiny_model):
    with pytest.raises(ValueError, match="strategy='self_speculative' reproduces greedy causal decoding"):
        tiny_model.generate(random_ids(1, 4), max_new_tokens=8, strategy="self_speculative", do_sample=True)


# ------------------------------------------------------------------------------------------------ sampling


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(tiny_model):
    prompt = random_ids(1, 6, seed=1)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=16, return_dict_in_generate=False)
    torch.manual_seed(0)
    first = tiny_model.generate(prompt, **kwargs)
    torch.manual_seed(0)
    again = tiny_model.generate(prompt, **kwargs)
    torch.manual_seed(1)
    other_seed = tiny_model.generate(prompt, **kwargs)
    with_generator = tiny_model.generate(prompt, generator=torch.Generator().manual_seed(5), **kwargs)
    torch.manual_seed(123)  # the global generator must not matter when one is passed
    with_generator_again = tiny_model.generate(prompt, generator=torch.Generator().manual_seed(5), **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other_seed)
    assert torch.equal(with_generator, with_generator_again)
    assert not torch.equal(with_generator, first)
    assert MASK_ID not in first.tolist()[0]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_with_top_k_1_decodes_exactly_as_greedy(model, temperature):
    """top_k=1 leaves one token to draw, the argmax; the threshold reads the untruncated distribution, so the
    same positions are committed per step as greedy commits: same tokens, same forwards."""
    prompt = random_ids(3, 6, seed=2)
    greedy = generate(model, prompt)
    sampled = generate(model, prompt, do_sample=True, top_k=1, temperature=temperature, top_p=0.95)
    assert torch.equal(sampled.sequences, greedy.sequences)
    assert torch.equal(sampled.num_forward_passes, greedy.num_forward_passes)
    assert sampled.steps_per_block == greedy.steps_per_block


# ------------------------------------------------------------------------------------------------ pure helpers


def test_candidates_and_confidence_takes_the_argmax_and_its_softmax_probability():
    # Row 0: probabilities (0.1, 0.6, 0.3) -> token 1 with 0.6. Row 1: the mask column (0) at -inf gets
    # probability 0; the rest (0.25, 0.75) -> token 2 with 0.75.
    scores = torch.tensor([[0.1, 0.6, 0.3], [0.0, 0.25, 0.75]]).log()
    scores[1, 0] = -math.inf
    candidate, confidence = candidates_and_confidence(scores)
    assert candidate.tolist() == [1, 2]
    torch.testing.assert_close(confidence, torch.tensor([0.6, 0.75]))


def test_candidates_and_confidence_samples_with_the_generator_and_never_a_zero_probability_token():
    # Token 1 holds all the probability except the -inf mask column: every sample is 1, with confidence 1.
    scores = torch.tensor([[-math.inf, 5.0, -math.inf]]).expand(64, -1)
    candidate, confidence = candidates_and_confidence(scores, scores, torch.Generator().manual_seed(0))
    assert candidate.tolist() == [1] * 64 and torch.equal(confidence, torch.ones(64))
    # Two equal tokens: a seeded generator draws the same samples twice, and both tokens occur.
    scores = torch.zeros(64, 2)
    draws = [candidates_and_confidence(scores, scores, torch.Generator().manual_seed(3))[0] for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and set(draws[0].tolist()) == {0, 1}


def test_confidence_of_a_sample_is_its_probability_before_truncation():
    # Model probabilities (0.5, 0.3, 0.2). top-k 1 keeps token 0 alone: its warped probability is 1.0, but the
    # confidence stays the model's 0.5, so a 0.95 threshold does not commit it. Temperature 0.5 sharpens the
    # draw (0.5^2 : 0.3^2 : 0.2^2) but not the confidence either.
    scores = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(16, -1)
    top_1 = TopKLogitsWarper(1)(None, scores)
    candidate, confidence = candidates_and_confidence(scores, top_1, torch.Generator().manual_seed(0))
    assert candidate.tolist() == [0] * 16
    torch.testing.assert_close(confidence, torch.full((16,), 0.5))
    candidate, confidence = candidates_and_confidence(scores, scores / 0.5, torch.Generator().manual_seed(0))
    expected = torch.tensor([0.5, 0.3, 0.2])[candidate]
    torch.testing.assert_close(confidence, expected)


CONFIDENCE = torch.tensor([[0.90, 0.50, 0.97, 0.20]])
IS_MASKED = torch.tensor([[True, True, False, True]])  # position 2 is already committed


@pytest.mark.parametrize(
    "threshold, min_to_commit, expected",
    [
        # threshold rule: masked positions >= 0.8 -> only 0 (2 reaches it too, but is committed already)
        (0.8, 1, [True, False, False, False]),
        # nothing masked reaches 0.95: the at-least-one rule commits the most confident masked one (0, not 2)
        (0.95, 1, [True, False, False, False]),
        # a low threshold commits every masked position above it, never the committed one
        (0.3, 1, [True, True, False, False]),
        # a step cap asking for 2: the two most confident masked positions (0.90, 0.50)
        (0.95, 2, [True, True, False, False]),
        # asking for more than are masked commits every masked position and still never position 2
        (0.95, 4, [True, True, False, True]),
    ],
)
def test_select_positions_to_commit(threshold, min_to_commit, expected):
    assert select_positions_to_commit(CONFIDENCE, IS_MASKED, threshold, min_to_commit).tolist() == [expected]


def test_select_positions_to_commit_takes_a_per_row_minimum():
    # Row 0 must commit 1 (its best masked: position 1, 0.7); row 1 must commit 2 (0.6 and 0.5, not the 0.9 at the
    # committed position 0).
    confidence = torch.tensor([[0.1, 0.7, 0.2], [0.9, 0.6, 0.5]])
    is_masked = torch.tensor([[True, True, True], [False, True, True]])
    selected = select_positions_to_commit(confidence, is_masked, 0.95, torch.tensor([1, 2]))
    assert selected.tolist() == [[False, True, False], [False, True, True]]


def test_min_commits_per_step_finishes_the_block_within_the_cap():
    # 7 masked with 2 steps left -> ceil(7 / 2) = 4 now; 1 masked with 3 steps left -> 1; no cap -> 1.
    is_masked = torch.tensor([[True] * 7 + [False], [True] + [False] * 7])
    assert min_commits_per_step(is_masked, 2).tolist()[0] == 4
    assert min_commits_per_step(is_masked, 3).tolist()[1] == 1
    assert min_commits_per_step(is_masked, None) == 1


def test_denoising_step_never_proposes_the_mask_token(tiny_model):
    # The mask column holds the largest logit everywhere; the runner-up (token 5 at 3.0) must be committed instead,
    # and committed positions (0) keep their token. lm_head is the identity, so the "hidden states" are the logits.
    tiny_model.lm_head = torch.nn.Identity()
    logits = torch.zeros(1, 4, 128)
    logits[..., MASK_ID] = 10.0
    logits[..., 5] = 3.0
    canvas = torch.tensor([[42, MASK_ID, MASK_ID, MASK_ID]])
    to_decode = canvas == MASK_ID
    config = CloverGenerationConfig(threshold=0.01, mask_token_id=MASK_ID)
    decoding = _Decoding(config, LogitsProcessorList(), None, torch.tensor([EOS_ID]), PAD_ID, 4, None, None)
    new_canvas, committed = tiny_model._denoising_step(canvas, logits, to_decode, canvas, decoding, None)
    assert new_canvas.tolist() == [[42, 5, 5, 5]]
    assert committed.tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_lm_head_on_undecided_positions_only_gives_the_same_tokens_as_the_whole_block(
    model, unequal_prompts, threshold
):
    _, input_ids, attention_mask = unequal_prompts
    rows_projected = {}

    def generate_counting(sparse):
        rows = []
        hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
        try:
            out = generate(model, input_ids, attention_mask=attention_mask, threshold=threshold, sparse_lm_head=sparse)
        finally:
            hook.remove()
        rows_projected[sparse] = sum(rows)
        return out

    sparse, dense = generate_counting(True), generate_counting(False)
    assert torch.equal(sparse.sequences, dense.sequences)
    assert torch.equal(sparse.num_forward_passes, dense.num_forward_passes)
    # dense: every position of every row at every step; sparse: only the still-masked ones (at one commit per step,
    # 8 + 7 + ... + 1 = 36 of a block's 64)
    assert rows_projected[False] == 2 * BLOCK * sum(dense.steps_per_block)
    assert rows_projected[True] <= 36 / 64 * rows_projected[False]


# ------------------------------------------------------------------------------------------------ output format


def test_output_stops_once_every_row_has_ended_and_pads_after_each_eos(model):
    """As autoregressive generate: max_new_tokens columns, fewer once every row has ended (through the last row's
    EOS), pad after each row's own EOS."""
    prompt = random_ids(1, 6, seed=1)
    eos_id = int(generate(model, prompt, threshold=0.3).sequences[0, 6 + 10])
    out = generate(model, prompt, threshold=0.3, eos_token_id=eos_id)
    assert isinstance(out, CloverGenerationOutput)
    assert torch.equal(out.sequences[:, :6], prompt)
    new = out.sequences[0, 6:].tolist()
    assert new.index(eos_id) == len(new) - 1 <= 10  # the lone row ends at its EOS
    assert int(out.num_new_tokens) == len(new)
    torch.testing.assert_close(out.tokens_per_forward, out.num_new_tokens / out.num_forward_passes)
    plain = model.generate(prompt, threshold=0.3, eos_token_id=eos_id, max_new_tokens=MAX_NEW_TOKENS)
    assert torch.equal(plain, out.sequences)
    # Beside a row that runs to the budget, the ended row is padded after its EOS to all the columns.
    other = next(p for seed in range(20) if eos_id not in generate(model, p := random_ids(1, 6, seed=seed), threshold=0.3).sequences[0, 6:].tolist())  # fmt: skip
    batch = generate(model, torch.cat([prompt, other]), threshold=0.3, eos_token_id=eos_id)
    assert batch.sequences.shape == (2, 6 + MAX_NEW_TOKENS)
    assert batch.sequences[0, 6 : 6 + len(new)].tolist() == new
    assert set(batch.sequences[0, 6 + len(new) :].tolist()) == {PAD_ID}


# ------------------------------------------------------------------------------------------------ streaming


class RecordingStreamer:
    def __init__(self):
        self.events = []

    def put(self, value):
        self.events.append(("put", value.clone()))

    def put_draft(self, value):
        self.events.append(("draft", value.clone()))

    def end(self):
        self.events.append(("end", None))


def test_streamer_gets_the_prompt_then_each_block_with_drafts_in_between(model):
    prompt = random_ids(1, 6, seed=1)
    streamer = RecordingStreamer()
    out = generate(model, prompt, threshold=0.3, streamer=streamer)
    kinds = [kind for kind, _ in streamer.events]
    assert kinds[0] == "put" and torch.equal(streamer.events[0][1].reshape(1, -1), prompt)
    assert kinds[-1] == "end" and kinds.count("end") == 1
    assert kinds.count("draft") == int(out.num_forward_passes)  # one draft per denoising step

    blocks, drafts = [], []
    for kind, value in streamer.events[1:-1]:
        if kind == "draft":
            drafts.append(value)
        else:  # a committed block: drafts came before it, the last one is the finished canvas
            assert drafts, "a block was put without a draft before it"
            assert drafts[-1][0, : value.numel()].tolist() == value.tolist()
            blocks.append(value)
            drafts = []
    assert [b.numel() for b in blocks] == [8, 8, 8, 6]
    assert torch.cat(blocks).tolist() == out.sequences[0, 6:].tolist()


def test_text_streamer_prints_the_new_tokens(model, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, TextStreamer

    backend = Tokenizer(WordLevel({f"t{i}": i for i in range(128)}, unk_token="t1"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt = random_ids(1, 6, seed=1)
    out = generate(model, prompt, threshold=0.3, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == tokenizer.decode(out.sequences[0, 6:]) + "\n"


# ------------------------------------------------------------------------------------------------ generation config


def test_generation_config_round_trips_through_a_directory(tmp_path):
    config = CloverGenerationConfig(threshold=0.7, block_size=8, max_steps_per_block=3, fuse_commit=False)
    config.save_pretrained(tmp_path)
    loaded = CloverGenerationConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, CloverGenerationConfig)
    assert (loaded.threshold, loaded.block_size, loaded.max_steps_per_block, loaded.fuse_commit) == (0.7, 8, 3, False)


def test_model_generation_config_is_a_clover_config_also_after_reloading(tiny_model, tmp_path):
    assert isinstance(tiny_model.generation_config, CloverGenerationConfig)
    assert (tiny_model.generation_config.block_size, tiny_model.generation_config.mask_token_id) == (BLOCK, MASK_ID)
    tiny_model.generation_config.threshold = 0.6
    tiny_model.save_pretrained(tmp_path)
    reloaded = CloverForBlockDiffusion.from_pretrained(tmp_path)
    assert isinstance(reloaded.generation_config, CloverGenerationConfig)
    assert reloaded.generation_config.threshold == 0.6


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(threshold=0.0), r"threshold \(0"),
        (dict(threshold=1.5), r"threshold \(1.5\)"),
        (dict(block_size=16), r"block_size \(16\)"),
        (dict(max_new_tokens=510), r"max_new_tokens \(510\)"),
        (dict(max_steps_per_block=0), r"max_steps_per_block \(0\)"),
    ],
)
def test_bad_generation_arguments_raise_value_error_naming_the_value(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_model.generate(random_ids(1, 6), **{"max_new_tokens": 8, **kwargs})


def test_generation_config_rejects_a_bad_threshold_on_creation():
    with pytest.raises(ValueError, match=r"threshold \(1.5\)"):
        CloverGenerationConfig(threshold=1.5)


def test_mask_token_in_the_prompt_raises_value_error(tiny_model):
    prompt = random_ids(1, 6)
    prompt[0, 2] = MASK_ID
    with pytest.raises(ValueError, match=f"mask token \\(id {MASK_ID}\\)"):
        tiny_model.generate(prompt, max_new_tokens=8)


def test_empty_prompt_raises_value_error(tiny_model):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_model.generate(torch.empty(1, 0, dtype=torch.long), max_new_tokens=8)


def test_right_padded_prompt_raises_value_error(tiny_model):
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="ends in padding"):
        tiny_model.generate(random_ids(1, 6), attention_mask=attention_mask, max_new_tokens=8)


@pytest.mark.parametrize(
    "input_ids, error, message",
    [
        (
            random_ids(1, 6).float(),
            TypeError,
            r"torch.float32 values; token ids are integers: pass input_ids.long\(\)",
        ),
        (random_ids(2, 1, 6), ValueError, r"shape \(2, 1, 6\); generate takes \(batch, prompt_len\)"),
        (random_ids(1, 6).tolist(), TypeError, r"not a list: pass tokenizer\(\.\.\., return_tensors='pt'\)"),
    ],
)
def test_malformed_input_ids_are_named_with_the_fix(tiny_model, input_ids, error, message):
    with pytest.raises(error, match=message):
        tiny_model.generate(input_ids, max_new_tokens=8)


@pytest.mark.parametrize("value", [8.0, "8"])
def test_a_non_integer_max_new_tokens_is_named(tiny_model, value):
    with pytest.raises(TypeError, match=rf"max_new_tokens \({value!r}\) must be an int"):
        tiny_model.generate(random_ids(1, 6), max_new_tokens=value)


def test_an_all_padding_row_is_named_as_empty_not_as_right_padding(tiny_model):
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] of attention_mask are all zeros"):
        tiny_model.generate(random_ids(2, 6), attention_mask=attention_mask, max_new_tokens=8)


def test_static_cache_step_gives_the_same_tokens(tiny_model, monkeypatch):
    # The compiled path's logic without the compiler: whole-buffer keys under a mask, the length as a tensor, GDN
    # states updated in place. Left padding and several blocks, fused and unfused commits.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    tiny_model._clover_compiled_forward = None
    prompt = torch.randint(2, 120, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    for fuse_commit in (True, False):
        kwargs = dict(attention_mask=mask, max_new_tokens=70, threshold=0.5, fuse_commit=fuse_commit)
        eager = tiny_model.generate(prompt, return_dict_in_generate=True, **kwargs)
        static = tiny_model.generate(prompt, compile=True, return_dict_in_generate=True, **kwargs)
        torch.testing.assert_close(static.sequences, eager.sequences, rtol=0, atol=0)
        torch.testing.assert_close(static.num_forward_passes, eager.num_forward_passes, rtol=0, atol=0)
    tiny_model._clover_compiled_forward = None


def test_static_cache_needs_max_length(tiny_config):
    with pytest.raises(ValueError, match="needs max_length"):
        CloverCache(tiny_config, static=True)


@pytest.mark.slow
def test_compiled_static_cache_path_gives_the_same_tokens(tiny_model):
    # torch.compile takes minutes on CPU: run with --runslow.
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tiny_model._clover_compiled_forward = None
    prompt = torch.randint(2, 120, (1, 11), generator=torch.Generator().manual_seed(3))
    eager = tiny_model.generate(prompt, max_new_tokens=100, threshold=0.5)
    compiled = tiny_model.generate(prompt, max_new_tokens=100, threshold=0.5, compile=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # Four blocks and many steps, yet two traces: the first block's step (32 tokens) and the fused one (64).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert not any("_clover_compiled_forward" in name for name in tiny_model.state_dict())


def test_chunked_prefill_gives_the_same_tokens_as_one_prefill(tiny_model):
    # Chunks of 5 cut through the prompt (and a padded row) at arbitrary points: the cache must not notice.
    prompt = torch.randint(2, 120, (2, 23), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    whole = tiny_model.generate(prompt, attention_mask=mask, max_new_tokens=20, threshold=0.5)
    chunked = tiny_model.generate(prompt, attention_mask=mask, max_new_tokens=20, threshold=0.5, prefill_chunk_size=5)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


def test_threshold_one_commits_a_single_position_even_when_probabilities_round_to_one():
    # Two masked positions whose fp32 probability is exactly 1.0: at threshold 1.0 only the first (stable order)
    # may be committed, so "one token per forward" holds whatever the logit margins.
    confidence = torch.tensor([[1.0, 1.0, 0.5]])
    is_masked = torch.tensor([[True, True, True]])
    commit = select_positions_to_commit(confidence, is_masked, threshold=1.0)
    assert commit.tolist() == [[True, False, False]]
