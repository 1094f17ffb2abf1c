"""Clover against its autoregressive base at equal accuracy, on held-out demo problems (`scripts/bench.py` is its
command line; its docstring lists what is measured).

`run_bench` loads both models and writes bench.json and bench.png; its parts measure one thing each: `decode_runs`
(every decoder on every problem), `step_profile` (where a denoising step's time goes), `step_time` (a step against
prompt length), `decoding_schedule` (the positions a step still decides).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..cache_clover import CloverCache
from ..cli_clover import checkpoint_dir, repository_label
from ..configuration_clover import CloverConfig
from ..modeling_clover import CloverForBlockDiffusion, rotary_inverse_frequencies
from .tasks import FAMILIES, check_reply, encode_example, generate_examples

THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7)
DRAFT_STEPS = (1, 2, 3, 4)
PROMPT_LENGTHS = (128, 512, 2048, 8192)
# Held out: the training corpora use seeds up to 53 (train_demo.py --seed up to 30, plus 0 to 7; the wording-bank
# corpora 40 to 53), eval_demo.py 12345.
BENCH_SEED = 4242
AR_BASE = "AR base"
AR_ONE_THREAD = f"{AR_BASE}, 1 thread"
# The rows decoded on llama.cpp (llama_cpp_clover) from a GGUF export of the same Clover: name -> strategy.
LLAMA_CPP_AR = "llama.cpp AR (same GGUF)"
LLAMA_CPP_DECODERS = {
    LLAMA_CPP_AR: "autoregressive",
    "llama.cpp Clover 0.95": "low_confidence",
    "llama.cpp Clover self-speculative": "self_speculative",
}


@torch.no_grad()
def run_bench(
    model: str,
    base: str,
    output: str,
    per_family: int = 6,
    thresholds=THRESHOLDS,
    draft_steps=DRAFT_STEPS,
    max_new_tokens: int = 192,
    prompt_lengths=PROMPT_LENGTHS,
    steps: int = 10,
    slice_35b: bool = True,
    llama_cpp: str | None = None,
) -> dict:
    """Benchmarks the Clover checkpoint `model` against its autoregressive base `base` on `per_family` held-out
    problems per task family; prints the tables, writes bench.json and bench.png to `output` and returns the report.
    With `llama_cpp` (a GGUF type, e.g. "f32"), the model is also exported and decoded on llama.cpp, on the same
    problems in the same run: llama.cpp's own AR decoding of that file, block diffusion at 0.95, self-speculative.
    """
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(model), trust_remote_code=True)
    clover = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True).eval()
    ar_base = AutoModelForCausalLM.from_pretrained(checkpoint_dir(base, "--base")).eval()
    examples = generate_examples(per_family * len(FAMILIES), seed=BENCH_SEED)

    with llama_cpp_model(model, llama_cpp) as llama:
        decoding = decode_runs(clover, ar_base, tokenizer, examples, thresholds, draft_steps, max_new_tokens, llama)
    profiles = {"shipped model": step_profile(clover)}
    if slice_35b:
        profiles["35B shape, 2-layer slice (bf16)"] = step_profile(slice_of_35b(), steps=2)
    schedule = decoding_schedule(clover, tokenizer, examples[:: max(1, len(examples) // 8)])
    times = step_time(clover, prompt_lengths, steps, schedule)
    shortest, longest = min(prompt_lengths), max(prompt_lengths)
    report = {
        "model": repository_label(model),
        "base": repository_label(base),
        "threads": torch.get_num_threads(),
        "problems": len(examples),
        "decoding": decoding,
        "step_profile_ms": profiles,
        "step_seconds": {str(k): v for k, v in times["first"].items()},
        "step_ratio_longest_to_shortest": times["first"][longest] / times["first"][shortest],
        "block_step_seconds": {str(k): v for k, v in times["block"].items()},
        "block_step_ratio_longest_to_shortest": times["block"][longest] / times["block"][shortest],
        "undecided_per_forward": schedule,
        "speed_reference": fastest_ar(decoding),
    }
    if llama_cpp:
        report["llama_cpp_type"] = llama_cpp
    print_report(report, prompt_lengths, clover.config.block_size)
    write_report(report, Path(output))
    return report


def print_report(report: dict, prompt_lengths, block_size: int) -> None:
    """The report's tables: decoders against the faster AR run, step profiles, step time against prompt length, and
    Clover 0.95's loop overhead."""
    decoding, schedule = report["decoding"], report["undecided_per_forward"]
    ar = decoding[report["speed_reference"]]
    print(f"{report['problems']} held-out problems, batch 1, greedy, {report['threads']} threads (\"vs AR\": against "
          f"{report['speed_reference']}, the faster AR run)")  # fmt: skip
    print(f"{'decoder':42} {'exact':>7} {'tok/s':>8} {'vs AR':>7} {'tok/fwd':>8}")
    for name, run in decoding.items():
        speedup = run["tok_per_s"] / ar["tok_per_s"]
        print(f"{name:42} {100 * run['exact_match']:6.1f}% {run['tok_per_s']:8.1f} {speedup:6.2f}x {run['tokens_per_forward']:8.2f}")  # fmt: skip
    for label, profile in report["step_profile_ms"].items():
        parts = ", ".join(f"{part} {ms:.2f}" for part, ms in profile.items() if part != "total")
        print(f"step profile, {label}: {profile['total']:.2f} ms = {parts}")
    mean_undecided = sum(count * share for count, share in schedule.items())
    print(f"ms per denoising step (first step of a block, all {block_size} masked | mean step of a "
          f"block at 0.95, {mean_undecided:.1f} undecided positions on average):")  # fmt: skip
    first, block = report["step_seconds"], report["block_step_seconds"]
    for length in prompt_lengths:
        print(f"  prompt {length:5}: {1000 * first[str(length)]:.2f} | {1000 * block[str(length)]:.2f}")
    print(
        f"step time {max(prompt_lengths)} / {min(prompt_lengths)}: first step "
        f"{report['step_ratio_longest_to_shortest']:.2f}, mean step "
        f"{report['block_step_ratio_longest_to_shortest']:.2f} (target <= 1.5)"
    )
    if LLAMA_CPP_AR in decoding:
        ar_cpp = decoding[LLAMA_CPP_AR]
        ratios = ", ".join(
            f"{name[len('llama.cpp ') :]} {decoding[name]['tok_per_s'] / ar_cpp['tok_per_s']:.2f}x"
            for name in LLAMA_CPP_DECODERS
            if name != LLAMA_CPP_AR
        )
        print(f"on llama.cpp ({report['llama_cpp_type']} GGUF), against its own AR decoding of the file: {ratios}")
    main_run = decoding.get("Clover 0.95")
    if main_run:
        print(
            f"Clover 0.95: loop overhead {main_run['loop_overhead']:.3f} (target <= 1.1; over the trunk alone "
            f"{main_run['loop_overhead_over_trunk']:.3f}), forwards per block "
            f"{main_run['forwards_per_block']:.2f}, denoising steps per block {main_run['steps_per_block']:.2f}"
        )


def write_report(report: dict, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=1))
    plot(report, output / "bench.png")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")


class ForwardTimer:
    """Adds up the wall time spent inside a module's forward."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self.calls = 0.0, 0
        self.handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---- 1. decoding at equal accuracy --------------------------------------------------------------------------------


@contextlib.contextmanager
def llama_cpp_model(model: str, gguf_type: str | None):
    """The checkpoint exported to a temporary GGUF of `gguf_type` and loaded on llama.cpp at torch's thread count
    (None when `gguf_type` is None)."""
    if gguf_type is None:
        yield None
        return
    import tempfile

    from ..gguf_clover import export_gguf
    from ..llama_cpp_clover import LlamaCppClover

    with tempfile.TemporaryDirectory() as folder:
        path = export_gguf(model, Path(folder) / f"model.{gguf_type}.gguf", gguf_type)
        llama = LlamaCppClover(path, n_threads=torch.get_num_threads())
        try:
            yield llama
        finally:
            llama.close()


def decode_runs(clover, base, tokenizer, examples, thresholds, draft_steps, max_new_tokens: int, llama=None) -> dict:
    """Every decoder on every problem, batch 1: per decoder tokens, seconds, forwards and exact matches (with
    `llama`, a `LlamaCppClover`, also the llama.cpp decoders).

    The decoders take turns on each problem, so a slower or faster spell of a shared machine falls on all of them
    alike and the speed ratios between them hold (run one decoder after another and the ratio moves with the
    machine)."""
    threads = torch.get_num_threads()
    decoders = {AR_BASE: None}
    if threads > 1:  # a one-token forward is small: a second thread may cost more than it gains
        decoders[AR_ONE_THREAD] = None
    decoders |= {f"Clover {t}": {"threshold": t} for t in thresholds}
    decoders["Clover self-speculative"] = {"strategy": "self_speculative"}
    for steps in draft_steps:  # drafts capped at this many denoising steps: cheaper, the same tokens
        decoders[f"Clover self-speculative, <= {steps} draft steps"] = {"strategy": "self_speculative", "max_steps_per_block": steps}  # fmt: skip
    if llama is not None:
        decoders |= {name: {"llama_cpp": strategy} for name, strategy in LLAMA_CPP_DECODERS.items()}
    eos_ids = torch.tensor(clover.generation_config.eos_token_id).reshape(-1)
    # The network's time: the trunk and the lm_head projection `generate` runs on the undecided positions.
    trunk, head = ForwardTimer(clover.model), ForwardTimer(clover.lm_head)
    runs = {name: defaultdict(float) for name in decoders}
    for example in tqdm(examples, desc="problems"):
        ids = torch.tensor([encode_example(tokenizer, example, clover.config.max_position_embeddings)[0]])
        for name, settings in decoders.items():
            run = runs[name]
            if settings is None:  # transformers' own autoregressive generate, KV cache
                with thread_count(1 if name == AR_ONE_THREAD else threads):
                    base.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
                    start = time.perf_counter()
                    new = base.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :]
                    seconds = time.perf_counter() - start
                is_eos = torch.isin(new, eos_ids)
                new_tokens = int(is_eos.float().argmax()) + 1 if bool(is_eos.any()) else len(new)
                forwards, blocks, steps = new_tokens, 0, 0
            elif "llama_cpp" in settings:  # greedy, the file's threshold (0.95)
                llama.generate(ids[0].tolist(), max_new_tokens=4, strategy=settings["llama_cpp"])  # warm-up
                start = time.perf_counter()
                out = llama.generate(ids[0].tolist(), max_new_tokens=max_new_tokens, strategy=settings["llama_cpp"])
                seconds = time.perf_counter() - start
                new, new_tokens, forwards = torch.tensor(out.tokens), out.num_new_tokens, out.num_forward_passes
                blocks, steps = len(out.steps_per_block), sum(out.steps_per_block)
            else:
                clover.generate(ids, max_new_tokens=4, **settings)  # warm-up
                trunk.seconds = head.seconds = 0.0
                start = time.perf_counter()
                out = clover.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **settings)
                seconds = time.perf_counter() - start
                new = out.sequences[0, ids.shape[1] :]
                new_tokens, forwards = int(out.num_new_tokens[0]), int(out.num_forward_passes[0])
                blocks, steps = len(out.steps_per_block), sum(out.steps_per_block)
                run["forward_seconds"] += trunk.seconds + head.seconds
                run["trunk_seconds"] += trunk.seconds
            reply = tokenizer.decode(new[:new_tokens], skip_special_tokens=True)
            run["correct"] += check_reply(example, reply)
            run["problems"] += 1
            run["new_tokens"] += new_tokens
            run["seconds"] += seconds
            run["forwards"] += forwards
            run["blocks"] += blocks
            run["denoising_steps"] += steps
    trunk.remove()
    head.remove()
    return {name: summarise(run) for name, run in runs.items()}


@contextlib.contextmanager
def thread_count(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def fastest_ar(decoding: dict) -> str:
    """The AR base run the speed ratios are taken against: the faster of its thread counts."""
    return max((name for name in decoding if name.startswith(AR_BASE)), key=lambda n: decoding[n]["tok_per_s"])


def summarise(run: dict) -> dict:
    summary = {
        "exact_match": run["correct"] / run["problems"],
        "tok_per_s": run["new_tokens"] / run["seconds"],
        "tokens_per_forward": run["new_tokens"] / run["forwards"],
        **{key: run[key] for key in ("problems", "new_tokens", "seconds", "forwards")},
    }
    if run["forward_seconds"]:
        summary["loop_overhead"] = run["seconds"] / run["forward_seconds"]
        summary["loop_overhead_over_trunk"] = run["seconds"] / run["trunk_seconds"]
    if run["blocks"]:
        summary["forwards_per_block"] = run["forwards"] / run["blocks"]
        summary["steps_per_block"] = run["denoising_steps"] / run["blocks"]
    return summary


# ---- 2. where a step's time goes ----------------------------------------------------------------------------------


PARTS = {
    "attention": lambda name: name.endswith(".self_attn"),
    "gated_deltanet": lambda name: name.endswith(".linear_attn"),
    "routed_experts": lambda name: name.endswith(".mlp.experts"),
    "router_and_shared_expert": lambda name: name.endswith(
        (".mlp.gate", ".mlp.shared_expert", ".mlp.shared_expert_gate")
    ),
    "lm_head": lambda name: name == "lm_head",
}


@torch.no_grad()
def step_profile(model, prompt_length: int = 256, steps: int = 5) -> dict:
    """Milliseconds of one denoising step (a block of masks on a committed cache, then lm_head on the block) per
    part; "rest" is what no part covers (embedding, norms, residuals, the mask, Python)."""
    timers = {part: [ForwardTimer(m) for n, m in model.named_modules() if match(n)] for part, match in PARTS.items()}
    cache, block, positions = prefilled_cache(model, prompt_length)
    totals = []
    for timer in (t for ts in timers.values() for t in ts):
        timer.seconds = 0.0
    for step in range(steps + 1):
        if step == 1:  # the first step warms caches up
            for timer in (t for ts in timers.values() for t in ts):
                timer.seconds = 0.0
        seconds = timed_step(model, cache, block, positions)
        if step:
            totals.append(seconds)
    profile = {part: 1000 * sum(t.seconds for t in ts) / steps for part, ts in timers.items()}
    profile["total"] = 1000 * sum(totals) / steps
    profile["rest"] = profile["total"] - sum(profile[part] for part in PARTS)
    for ts in timers.values():
        for timer in ts:
            timer.remove()
    return profile


def timed_step(model, cache, block, positions, keep: torch.Tensor | None = None) -> float:
    """Seconds of one denoising forward of `block` on the committed `cache` (one unpadded block, as generate runs it),
    then lm_head on the block; with `keep` (block columns) the last layer and lm_head run only there."""
    start = time.perf_counter()
    hidden = model.model(
        input_ids=block,
        past_key_values=cache,
        block_ids=0,
        position_ids=positions,
        use_cache=False,
        positions_to_keep=keep,
    )
    model.lm_head(hidden.last_hidden_state)
    return time.perf_counter() - start


def prefilled_cache(model, length: int):
    config = model.config
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.mask_token_id, (1, length), generator=generator)
    cache = CloverCache(config)
    model.model(input_ids=prompt, past_key_values=cache, use_cache=True)
    block = torch.full((1, config.block_size), config.mask_token_id)
    return cache, block, torch.arange(length, length + config.block_size)[None]


def slice_of_35b() -> CloverForBlockDiffusion:
    """Clover-35B-A3B's shapes (hidden 2048, 256 experts top-8, the real vocabulary) with one Gated DeltaNet and one
    attention layer, random bf16 weights (5.4 GB): what one step of the real model costs per layer kind."""
    config = CloverConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu").eval()  # allocated in bf16, never in fp32
    with torch.no_grad():
        for param in model.parameters():  # random, so that the router spreads tokens over the experts
            param.normal_(0.0, 0.02)
        model.model.rotary_emb.inv_freq.copy_(rotary_inverse_frequencies(config))
    return model


# ---- 3. step time against prompt length ---------------------------------------------------------------------------


@torch.no_grad()
def step_time(model, prompt_lengths, steps, schedule: dict[int, float] | None = None) -> dict:
    """Median seconds of one denoising forward (as generate runs it for an unpadded prompt) per prompt length: the
    first step of a block, every position masked, and with `schedule` ({undecided positions: share of forwards}) the
    mean step of a real block, whose later steps run the last layer and lm_head only where a token is undecided.

    The lengths take turns, one step each per round, so a slower or faster spell of a shared machine falls on all of
    them alike and the ratio between them holds; the first two rounds warm caches up and are not counted."""
    prefilled = {length: prefilled_cache(model, length) for length in prompt_lengths}
    kinds = [None, *(schedule or {})]  # None: the all-masked first step, no positions_to_keep
    times = {(length, kind): [] for length in prompt_lengths for kind in kinds}
    for _ in range(steps + 2):
        for kind in kinds:
            for length, (cache, block, positions) in prefilled.items():
                keep = None if kind is None else torch.arange(kind)
                times[length, kind].append(timed_step(model, cache, block, positions, keep))
    median = {key: statistics.median(seconds[2:]) for key, seconds in times.items()}
    result = {"first": {length: median[length, None] for length in prompt_lengths}}
    if schedule:
        result["block"] = {
            length: sum(share * median[length, kind] for kind, share in schedule.items()) for length in prompt_lengths
        }
    return result


@torch.no_grad()
def decoding_schedule(model, tokenizer, examples, threshold: float = 0.95) -> dict[int, float]:
    """How many positions each denoising forward of `generate` still decides, as {count: share of forwards}, over
    `examples` at `threshold` (batch 1); forwards that only fill the cache are not counted."""
    counts: list[int] = []
    decode_step = model.decode_step

    def counting(input_ids, **kwargs):
        keep = kwargs.get("positions_to_keep")
        if keep is None or keep.numel():
            counts.append(model.config.block_size if keep is None else keep.numel())
        return decode_step(input_ids, **kwargs)

    model.decode_step = counting
    try:
        for example in examples:
            ids = torch.tensor([encode_example(tokenizer, example, model.config.max_position_embeddings)[0]])
            model.generate(ids, max_new_tokens=192, threshold=threshold)
    finally:
        del model.decode_step  # the class's method again
    return {count: n / len(counts) for count, n in sorted(Counter(counts).items())}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["decoding"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    speculative = [name for name in runs if "speculative" in name]  # often at one accuracy: labels above, below
    for name, run in runs.items():
        marker, color = ("s", "black") if name.startswith(AR_BASE) else ("*", "tab:red") if name in speculative else ("o", "tab:green")  # fmt: skip
        ax.scatter(run["tok_per_s"], 100 * run["exact_match"], marker=marker, color=color, s=60, zorder=3)
        if name not in speculative:  # the self-speculative points sit close together: listed in a box instead
            offset = (5, 6) if name == AR_ONE_THREAD else (5, -10)  # the two AR runs sit on one another
            ax.annotate(name.removeprefix("Clover "), (run["tok_per_s"], 100 * run["exact_match"]), fontsize=8,
                        textcoords="offset points", xytext=offset)  # fmt: skip
    if speculative:
        lines = ["self-speculative (stars), tok/s:"]
        for name in speculative:
            cap = name.rpartition(", ")[2].removesuffix(" draft steps") + " steps" if "<=" in name else "uncapped"
            lines.append(f"{cap}: {runs[name]['tok_per_s']:.0f} ({100 * runs[name]['exact_match']:.1f}%)")
        ax.text(0.55, 0.04, "\n".join(lines), transform=ax.transAxes, fontsize=7, ha="center", va="bottom",
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "tab:red", "alpha": 0.9})  # fmt: skip
    ax.margins(y=0.15)
    low_confidence = [r for n, r in runs.items() if n.startswith("Clover") and "speculative" not in n]
    ax.plot(
        [r["tok_per_s"] for r in low_confidence],
        [100 * r["exact_match"] for r in low_confidence],
        color="tab:green",
        lw=0.8,
    )
    ax.set_xlabel("tokens / s (batch 1, this CPU)")
    ax.set_ylabel("exact match on held-out problems (%)")
    ax.grid(alpha=0.3)
    ax.set_title("Clover (LowConfidence thresholds, self-speculative) vs its AR base")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "AR_BASE",
    "AR_ONE_THREAD",
    "BENCH_SEED",
    "THRESHOLDS",
    "decode_runs",
    "decoding_schedule",
    "print_report",
    "run_bench",
    "slice_of_35b",
    "step_profile",
    "step_time",
    "write_report",
]
