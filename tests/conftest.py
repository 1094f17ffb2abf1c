"""Shared fixtures and helpers: a tiny Clover (vocab 128, hidden 64, 4 layers), random prompt ids, the code files
a checkpoint carries, and the `--runslow` switch. Test modules import the helpers with `from conftest import ...`."""

import inspect
import os
import subprocess
import sys

import pytest
import torch
from transformers import PretrainedConfig, Qwen3_5MoeTextConfig

from clover.configuration_clover import CloverConfig
from clover.conversion_clover import CODE_FILES
from clover.modeling_clover import CloverForBlockDiffusion

__all__ = ["CODE_FILES", "qwen_config_from", "random_ids", "run_python", "spy_experts_kernel"]

TINY_FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    head_dim=32,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    pad_token_id=0,
    eos_token_id=126,
    block_size=8,
    mask_token_id=127,
)


def run_python(*arguments: str, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python ARGUMENTS` in a fresh process as a user runs it: stdin closed, offline, one thread."""
    return subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


def random_ids(*shape, seed=0) -> torch.Tensor:
    """Token ids of the tiny config in [1, 126): no pad (0), EOS (126) or mask (127)."""
    return torch.randint(1, 126, shape, generator=torch.Generator().manual_seed(seed))


def qwen_config_from(config: CloverConfig) -> Qwen3_5MoeTextConfig:
    """The Qwen3.5-MoE text config with the same architecture fields (they convert field for field)."""
    generic = set(inspect.signature(PretrainedConfig.__init__).parameters)
    names = set(inspect.signature(Qwen3_5MoeTextConfig.__init__).parameters) - generic - {"self", "kwargs"}
    return Qwen3_5MoeTextConfig(**{name: getattr(config, name) for name in names if hasattr(config, name)})


def _tiny_config(**overrides) -> CloverConfig:
    return CloverConfig(**{**TINY_FIELDS, **overrides})


@pytest.fixture(scope="session")
def tiny_config():
    """A factory: `tiny_config(**overrides)` returns a fresh tiny CloverConfig (vocab 128, hidden 64, layers
    [linear, linear, linear, full], 8 experts top-2, block 8, mask 127, pad 0, eos 126)."""
    return _tiny_config


@pytest.fixture
def tiny_model(tiny_config):
    """A seeded, float32, eval-mode tiny CloverForBlockDiffusion (a fresh one per test: tests may modify it)."""
    torch.manual_seed(0)
    return CloverForBlockDiffusion(tiny_config()).float().eval()


def pytest_configure(config):
    # Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine they make each op 10x slower.
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def spy_experts_kernel(monkeypatch, experts_implementation: str) -> list[int]:
    """Counts the calls of a non-eager experts kernel (one per MoE layer per forward), to prove it really runs
    instead of the eager loop. Returns the list the calls are appended to (stays empty for "eager")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    calls: list[int] = []
    if experts_implementation != "eager":
        kernel = ALL_EXPERTS_FUNCTIONS[experts_implementation]
        monkeypatch.setitem(
            ALL_EXPERTS_FUNCTIONS._local_mapping,
            experts_implementation,
            lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
        )
    return calls


def spy_attention(monkeypatch, attn_implementation: str) -> list[tuple[int, int, object]]:
    """Records every call of Clover's attention function as (queries, keys, mask), the mask None when attention ran
    without one. Returns the list the calls are appended to."""
    from clover import modeling_clover

    calls: list[tuple[int, int, object]] = []
    attention = modeling_clover.ATTENTION_FUNCTIONS[attn_implementation]

    def spy(query, key, value, mask, scaling):
        calls.append((query.shape[-2], key.shape[-2], mask))
        return attention(query, key, value, mask, scaling)

    monkeypatch.setitem(modeling_clover.ATTENTION_FUNCTIONS, attn_implementation, spy)
    return calls
