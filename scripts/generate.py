"""Chat with a Clover checkpoint (the shipped tiny demo model by default), streaming each committed block.

    python scripts/generate.py "What is 4821 + 377?"
    python scripts/generate.py --model DIR --no-thinking --system "You are terse." "Sort 5, 3, 9."
    python scripts/generate.py --demo-tools "What is the weather in Paris?"   # the demo model's tools
    python scripts/generate.py --tools tools.json --strategy self_speculative "..."
    python scripts/generate.py --raw "Once upon a time"          # plain prompt, no chat template
    python scripts/generate.py --gguf clover.gguf "Sort 5, 3, 9."   # on llama.cpp (scripts/export_gguf.py)

Thinking is shown apart from the answer (the chat template's default: on); the last line gives new tokens,
forwards, tokens per forward and tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer
from transformers.utils import logging as transformers_logging

from clover.cli_clover import checkpoint_dir, run_main

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "clover-tiny-demo"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="What is 48213 + 9377?")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Clover checkpoint directory")
    parser.add_argument("--gguf", default=None, help="decode this GGUF file on llama.cpp instead (docs/llama_cpp.md)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: 256, or what the context leaves after the prompt"
    )
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument(
        "--strategy", choices=["low_confidence", "self_speculative"], default="low_confidence",
        help="block diffusion, or drafts verified by the causal forward (its greedy output, exactly)",
    )  # fmt: skip
    parser.add_argument(
        "--thinking", action=argparse.BooleanOptionalAction, default=None,
        help="enable_thinking in the chat template (default: the template's, on)",
    )  # fmt: skip
    parser.add_argument("--tools", type=Path, default=None, help="a JSON file with a list of tool schemas")
    parser.add_argument("--demo-tools", action="store_true", help="offer the tools the demo model was trained on")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.7)
    return parser.parse_args(argv)


class ThinkingStreamer(TextStreamer):
    """Prints committed blocks as they come; the reasoning (before </think>) is labelled, and dimmed on a terminal."""

    def __init__(self, tokenizer, thinking: bool, styled: bool):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.in_thinking = thinking
        self.dim, self.plain = ("\033[2m", "\033[0m") if styled else ("", "")
        if thinking:
            print(f"{self.dim}[thinking] ", end="", flush=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self.in_thinking and "</think>" in text:
            before, after = text.split("</think>", 1)
            print(before.rstrip() + f"{self.plain}\n[answer] " + after.lstrip(), end="", flush=True)
            self.in_thinking = False
        else:
            print(text, end="", flush=True)
        if stream_end:
            print(self.plain if self.in_thinking else "", flush=True)


def read_tools(args) -> list[dict] | None:
    if args.tools and args.demo_tools:
        raise ValueError("Pass --tools FILE or --demo-tools, not both.")
    if args.demo_tools:
        from clover.demo.tasks import demo_tool_schemas

        return demo_tool_schemas()
    if args.tools is None:
        return None
    try:
        tools = json.loads(args.tools.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--tools {args.tools}: not a readable JSON file ({error}).") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError(f"--tools {args.tools}: expected a JSON list of tool schemas (objects).")
    return tools


def chat_request(args) -> tuple[list[dict], dict]:
    """The chat the prompt makes (the --system turn first) and the template options it asks for."""
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return messages, {} if args.thinking is None else {"enable_thinking": args.thinking}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.prompt.strip():
        raise ValueError(
            'The prompt is empty: pass the text to answer, e.g. python scripts/generate.py "What is 2 + 2?"'
        )
    if args.strategy == "self_speculative" and args.do_sample:
        raise ValueError("--strategy self_speculative reproduces greedy decoding: drop --do-sample.")
    if args.gguf:
        return generate_gguf(args, read_tools(args))
    checkpoint_dir(args.model)
    model_type = AutoConfig.from_pretrained(args.model, trust_remote_code=True).model_type
    if model_type != "clover":
        raise ValueError(
            f"{args.model} is a {model_type} checkpoint, not a Clover one: this script decodes Clover by block "
            "diffusion. Pass a Clover checkpoint, or convert a Qwen3.5-MoE one first with python "
            "scripts/convert_qwen3_5_moe.py --input DIR --output CLOVER_DIR (then adapt it with scripts/train.py)."
        )
    tools = read_tools(args)
    torch.set_grad_enabled(False)
    transformers_logging.disable_progress_bar()  # no weight-loading bar before the answer
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, device_map="auto")
    thinking = args.thinking is not False and not args.raw
    if args.raw:
        text = args.prompt
    else:
        messages, options = chat_request(args)
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **options
        )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    room = model.config.max_position_embeddings - inputs["input_ids"].shape[1]
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else max(min(256, room), 1)
    streamer = ThinkingStreamer(tokenizer, thinking, styled=sys.stdout.isatty())
    start = time.perf_counter()
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        threshold=args.threshold,
        strategy=args.strategy,
        do_sample=args.do_sample,
        temperature=args.temperature if args.do_sample else None,
        streamer=streamer,
        return_dict_in_generate=True,
    )
    seconds = time.perf_counter() - start
    new_tokens = int(output.num_new_tokens[0])
    forwards = int(output.num_forward_passes[0])
    print(
        f"-- {new_tokens} new tokens, {forwards} forwards, {new_tokens / max(forwards, 1):.2f} tokens/forward, "
        f"{new_tokens / seconds:.1f} tok/s"
    )


def generate_gguf(args, tools) -> None:
    """The same chat on llama.cpp: the file's own tokenizer and chat template, Clover's decoding rule."""
    from clover.llama_cpp_clover import LlamaCppClover

    model = LlamaCppClover(args.gguf, n_ctx=8192)
    if args.raw:
        text = args.prompt
    else:
        messages, options = chat_request(args)
        text = model.apply_chat_template(messages, tools=tools, **options)
    ids = model.tokenize(text)
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else 256
    streamer = ThinkingStreamer(None, args.thinking is not False and not args.raw, styled=sys.stdout.isatty())

    new_tokens, shown = [], ""

    def stream(tokens):  # the text so far, minus what was shown; a character split across blocks waits
        nonlocal shown
        new_tokens.extend(tokens)
        text = model.detokenize(new_tokens)
        if not text.endswith("\ufffd"):
            streamer.on_finalized_text(text[len(shown) :])
            shown = text

    start = time.perf_counter()
    output = model.generate(
        ids, max_new_tokens=max_new_tokens, threshold=args.threshold, strategy=args.strategy,
        do_sample=args.do_sample, temperature=args.temperature if args.do_sample else None, streamer=stream,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    streamer.on_finalized_text("", stream_end=True)
    print(
        f"-- {output.num_new_tokens} new tokens, {output.num_forward_passes} forwards, "
        f"{output.tokens_per_forward:.2f} tokens/forward, {output.num_new_tokens / seconds:.1f} tok/s"
    )


if __name__ == "__main__":
    run_main(main)
