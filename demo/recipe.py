"""The recipe of the tiny demo models, the way Clover was made: an autoregressive base, its conversion, the adaptation.

(`scripts/train_demo.py` is its command line.)

1. data:    the demo tokenizer and the chat corpus (JSONL, training seed 1; eval_demo.py holds out seed 12345),
            with a warm-up set of smaller problems (`demo.tasks.LEVELS`) that the base starts on;
2. base:    transformers' Qwen3_5MoeForCausalLM (Gated DeltaNet and gated attention, alternating), trained causally
            on the answers with transformers.Trainer, warm-up first -> --base-output (a plain Qwen3.5-MoE
            checkpoint: the AR model Clover is compared with);
3. convert: scripts/convert_qwen3_5_moe.py turns the base into a Clover checkpoint;
4. adapt:   scripts/train.py trains it with the block-diffusion objective (plus a causal next-token loss) ->
            --output (the shipped Clover), with one learning-curve plot of both stages.

Everything in progress lives in --work: the settings of the run (run.json), Trainer checkpoints of the two training
stages (every --save-steps; an interrupted stage resumes from its newest one, optimizer, scheduler and data
position included), and the converted checkpoint. The two outputs are written whole or not at all, and an output
this run did not write is replaced only with --force. A finished base or adaptation rerun with a larger --base-steps
or --adapt-steps goes on from its last checkpoint (after a longer base, convert and adapt are redone), and an
adaptation rerun with other settings starts again from the converted base; either way the replaced stages'
checkpoints and records are kept (adapt-before-base-N, adapt-N, run.json's "superseded").
Other changed settings of a begun stage are refused: its checkpoints would not fit.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, Trainer

from ..chat_data_clover import encode_chat_examples, read_chat_jsonl
from ..cli_clover import replace_directory
from ..training_clover import token_budget_batches
from .base_model import CausalChatCollator, causal_training_arguments
from .tasks import FAMILIES, LEVELS, OUT_OF_SCOPE, build_demo_tokenizer, generate_examples, write_chat_jsonl

REPO = Path(__file__).resolve().parents[1]
STAGES = ("data", "base", "convert", "adapt")

# Clover's layer kinds at the demo's size: Gated DeltaNet and gated full attention, alternating. Measured on the
# reversal family at this width (causal, 300 steps): with one attention layer in four (Clover's 3:1, "lllf", or
# "lfll") or with attention only every fourth layer of eight ("lllflllf"), copying from the prompt had not started
# (token accuracy 42-44%, the separators); alternating ("lflf") it had reached 83%.
DEMO_ARCHITECTURE = dict(
    hidden_size=192,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=48,
    linear_value_head_dim=48,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=160,
    shared_expert_intermediate_size=192,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)

# Relative number of training examples per family. A tool-call prompt carries the tool list (about 320 tokens
# against 35 to 55 for the others), so that family gets fewer examples for its share of the compute.
TRAINING_MIX = (0.3, 0.26, 0.24, 0.2)
# Worded by the bank (`--wording train`), this share of the conversations are requests outside the families,
# answered by the fixed reply.
OUT_OF_SCOPE_SHARE = 0.1


STAGE_SETTINGS = {
    "data": ("num_examples", "copy_warmup_examples", "warmup_examples", "mix", "easy_direct_sums", "direct_sums",
             "worked_additions", "hard_examples", "column_sum_width", "vocab_size", "wording", "seed"),
    "base": ("hidden_size", "layers", "moe_intermediate_size", "shared_expert_intermediate_size", "batch_tokens",
             "base_steps", "base_lr"),
    "convert": (),
    "adapt": ("adapt_steps", "adapt_lr", "noise_eps", "causal_loss_weight"),
}  # fmt: skip
# Settings added after runs were recorded without them, with the value those runs had.
ADDED_SETTINGS = {
    "easy_direct_sums": 0, "direct_sums": 0, "worked_additions": 0, "hard_examples": 0, "column_sum_width": 1,
    "wording": "templates",
}  # fmt: skip
# The setting that a finished stage may raise, to train on from its last checkpoint.
EXTENDABLE = {"base": "base_steps", "adapt": "adapt_steps"}


class Run:
    """run.json in the work directory: per stage its settings, and when it finished and how long it took."""

    def __init__(self, args):
        self.work = Path(args.work)
        self.path = self.work / "run.json"
        self.settings = {stage: {key: getattr(args, key) for key in keys} for stage, keys in STAGE_SETTINGS.items()}
        self.stages = {}
        if self.path.is_file():
            record = json.loads(self.path.read_text())
            self.stages = record["stages"]
            for stage, ours in self.settings.items():
                theirs = record["settings"].get(stage, ours)
                before = {key: theirs.get(key, ADDED_SETTINGS.get(key)) for key in ours}
                changed = {key: (before[key], value) for key, value in ours.items() if before[key] != value}
                if not changed or not self.started(stage):
                    continue
                if self._extends(stage, changed):
                    continue
                if stage == "adapt":
                    self._redo_adapt(changed, theirs)
                    continue
                raise ValueError(
                    f"{self.work} holds a {stage} stage begun with other settings ({describe(changed)}); its "
                    "checkpoints would not fit. Rerun with its settings, or pass another --work."
                )
        self.work.mkdir(parents=True, exist_ok=True)
        self.save()

    def _extends(self, stage: str, changed: dict) -> bool:
        """A finished base or adaptation rerun with more steps, nothing else changed, resumes from its last
        checkpoint. The cosine schedule is then that of the new length, so the learning rate rises again (to about
        0.4 of the peak when 2,600 steps become 4,600) and decays to zero over the added steps. After a longer base,
        convert and adapt are redone, and the previous adaptation's checkpoints are kept in adapt-before-base-N."""
        key = EXTENDABLE.get(stage)
        if key is None or set(changed) != {key} or stage not in self.stages:
            return False
        before, after = changed[key]
        if after <= before:
            return False
        if stage == "base":
            print(f"base: extending {before} steps to {after}; convert and adapt will be redone")
        else:
            print(f"adapt: extending {before} steps to {after} from its last checkpoint")
        redone = STAGES[STAGES.index(stage) :]  # the stage itself and every stage after it
        self._set_aside(redone, f"adapt-before-base-{after}" if stage == "base" else None)  # records carry steps
        return True

    def _redo_adapt(self, changed: dict, theirs: dict) -> None:
        """An adaptation with other settings starts again from the converted base; the base is kept. The previous
        adaptation's checkpoints are moved to adapt-N and its record to stages.superseded, so nothing is lost."""
        kept = f"adapt-{1 + sum(1 for _ in self.work.glob('adapt-[0-9]*'))}"
        print(
            f"adapt: other settings ({describe(changed)}); the adaptation is redone, the previous one kept in {kept}"
        )
        self._set_aside(("adapt",), kept, settings=theirs)

    def _set_aside(self, stages: tuple[str, ...], adapt_checkpoints: str | None, **facts) -> None:
        """Moves the records of `stages` to stages.superseded (a second record of a stage there is `stage-2`, and
        so on) and, unless `adapt_checkpoints` is None, the adaptation's checkpoints to that folder."""
        superseded = self.stages.setdefault("superseded", {})
        for stage in (stage for stage in stages if stage in self.stages):
            earlier = sum(1 for key in superseded if key.split("-")[0] == stage)
            superseded[f"{stage}-{earlier + 1}" if earlier else stage] = facts | self.stages.pop(stage)
        if adapt_checkpoints and (self.work / "adapt").exists():
            (self.work / "adapt").rename(self.work / adapt_checkpoints)

    def started(self, stage: str) -> bool:
        return stage in self.stages or any((self.work / stage).glob("checkpoint-*"))

    def save(self) -> None:
        self.path.write_text(json.dumps({"settings": self.settings, "stages": self.stages}, indent=1))

    def done(self, stage: str) -> bool:
        return stage in self.stages

    def finish(self, stage: str, seconds: float, **facts) -> None:
        self.stages[stage] = {"seconds": round(seconds), **facts}
        self.save()


def describe(changed: dict) -> str:
    return ", ".join(f"{key}: {before} -> {after}" for key, (before, after) in changed.items())


def architecture(args) -> dict:
    kinds = {"l": "linear_attention", "f": "full_attention"}
    if not args.layers or set(args.layers) - set(kinds):
        raise ValueError(f"--layers ({args.layers!r}) must be a string of l (Gated DeltaNet) and f (full attention).")
    return {**DEMO_ARCHITECTURE, "hidden_size": args.hidden_size, "num_hidden_layers": len(args.layers),
            "layer_types": [kinds[c] for c in args.layers], "moe_intermediate_size": args.moe_intermediate_size,
            "shared_expert_intermediate_size": args.shared_expert_intermediate_size}  # fmt: skip


def check_output(path: Path, run: Run, stage: str, force: bool) -> None:
    """An existing output that another run wrote is kept unless --force: it may be the only copy of a model."""
    if path.exists() and any(path.iterdir()) and not force:
        written = {
            run.stages.get(stage, {}).get("output"),
            run.stages.get("superseded", {}).get(stage, {}).get("output"),
        }
        if str(path.resolve()) not in written:
            raise ValueError(f"{path} exists and this run did not write it; pass --force to replace it (it is "
                             "replaced only once the new model is complete), or choose another output.")  # fmt: skip


def last_checkpoint(directory: Path) -> str | None:
    checkpoints = sorted(directory.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(checkpoints[-1]) if checkpoints else None


def check_resume_point(checkpoint: str, expected: dict) -> None:
    """--resume-from must name a Trainer checkpoint of this stage's model."""
    path = Path(checkpoint)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"--resume-from {path}: no Trainer checkpoint there (no trainer_state.json).")
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    differs = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
    if differs:
        raise ValueError(
            f"--resume-from {path} is a checkpoint of another model "
            f"({', '.join(f'{k}={a!r}, this run has {b!r}' for k, (a, b) in differs.items())})."
        )


# ---- stages ------------------------------------------------------------------------------------------------------


def stage_data(args, run: Run) -> None:
    """The tokenizer, then the corpus rendered by it: train.jsonl and a small eval.jsonl (another seed)."""
    work = run.work
    tokenizer = build_demo_tokenizer(work / "tokenizer", vocab_size=args.vocab_size, seed=args.seed,
                                     wording=args.wording)  # fmt: skip
    # Worded by the bank, the corpus is every size a user may ask about, with requests outside the families too.
    full, warmup_level, hard = (
        replace(LEVELS[name], column_sum_width=args.column_sum_width)
        for name in ("full" if args.wording == "templates" else "wide", "warmup", "hard")
    )
    families, mix = FAMILIES, list(args.mix)
    if args.wording != "templates":
        families, mix = FAMILIES + (OUT_OF_SCOPE,), mix + [sum(mix) * OUT_OF_SCOPE_SHARE / (1 - OUT_OF_SCOPE_SHARE)]

    def examples(num, seed, families=families, weights=mix, level=full, **kwargs):
        return generate_examples(num, seed, families, weights, level, wording=args.wording, **kwargs)

    # Training conversations come from seed + 1 (the warm-ups from seeds + 3 and + 4), the eval-loss split from
    # seed + 2; eval_demo.py uses 12345.
    train = examples(args.num_examples, args.seed + 1)
    # A direct sum (thinking off, 2-3 digit operands) is learned from 2-digit ones first: trained on 2-3 digit sums
    # alone the base stayed at chance in the units digit for 400 steps, on 2-digit ones it took off within 300.
    easy_sums = examples(
        args.easy_direct_sums, args.seed + 5, ("addition",), None, warmup_level, enable_thinking=False
    )
    direct_sums = examples(args.direct_sums, args.seed + 7, ("addition",), None, enable_thinking=False)
    # The worked additions get better the more of the steps they take: the base trained on them alone went from
    # 17 to 37 of 48 held-out ones in 300 steps, while in the full mix they stayed near half.
    worked = examples(args.worked_additions, args.seed + 6, ("addition",), None, enable_thinking=True)
    # The errors of a trained model gather at the top of each family's size range (see `demo.tasks.LEVELS`).
    hardest = examples(args.hard_examples, args.seed + 8, FAMILIES, args.mix, hard)
    extras = easy_sums + direct_sums + worked + hardest
    if extras:
        train += extras
        random.Random(args.seed + 5).shuffle(train)
    write_chat_jsonl(train, work / "train.jsonl")
    copy_warmup = examples(args.copy_warmup_examples, args.seed + 4, ("reversal",), None, warmup_level)
    write_chat_jsonl(copy_warmup, work / "warmup-copy.jsonl")
    warmup = examples(args.warmup_examples, args.seed + 3, level=warmup_level)
    write_chat_jsonl(warmup, work / "warmup.jsonl")
    write_chat_jsonl(examples(256, args.seed + 2, weights=None), work / "eval.jsonl")
    print(f"data: tokenizer of {len(tokenizer)} tokens; {len(copy_warmup)} + {len(warmup)} warm-up and {len(train)} "
          "training conversations")  # fmt: skip


def encoded(path: Path, tokenizer, max_length: int) -> list[dict]:
    return encode_chat_examples(tokenizer, read_chat_jsonl(path), max_length)


def curriculum(args, warmups: list[list[dict]], train: list[dict], steps: int) -> list[list[dict]]:
    """The base's batches in the order they are trained on: each warm-up's in turn (reversals of a few common words
    first: the copying they teach carries over, see `demo.tasks.DemoLevel`), then the full corpus's, reshuffled as
    often as `steps` needs (Trainer reads them in order, `train_sampling_strategy="sequential"`)."""
    batches = [batch for warmup in warmups for batch in token_budget_batches(warmup, args.batch_tokens, args.seed)]
    epoch = 0
    while len(batches) < steps:
        batches += token_budget_batches(train, args.batch_tokens, args.seed + epoch)
        epoch += 1
    return batches


def stage_base(args, run: Run, resume: str | None) -> None:
    """transformers' own Qwen3_5MoeForCausalLM, next-token loss on the answer tokens, transformers.Trainer."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    work, output = run.work, Path(args.base_output)
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    config = Qwen3_5MoeTextConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **architecture(args),
    )
    torch.manual_seed(args.seed)
    model = Qwen3_5MoeForCausalLM(config)
    print(f"base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    max_length = config.max_position_embeddings
    copy_warmup, warmup, full = (
        encoded(work / name, tokenizer, max_length) for name in ("warmup-copy.jsonl", "warmup.jsonl", "train.jsonl")
    )
    train = curriculum(args, [copy_warmup, warmup], full, args.base_steps)
    held_out = token_budget_batches(encoded(work / "eval.jsonl", tokenizer, max_length), args.batch_tokens, args.seed)
    checkpoints = work / "base"
    resume = resume or last_checkpoint(checkpoints)
    if resume:
        check_resume_point(resume, {"model_type": config.model_type, "hidden_size": config.hidden_size,
                                    "layer_types": config.layer_types, "vocab_size": config.vocab_size})  # fmt: skip
        print(f"base: resuming from {resume}")
    trainer = Trainer(
        model=model,
        args=causal_training_arguments(
            checkpoints, args.base_steps, args.base_lr, save_steps=args.save_steps, seed=args.seed
        ),
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=CausalChatCollator(tokenizer.pad_token_id),
    )
    start = time.time()
    trainer.train(resume_from_checkpoint=resume)

    staging = output.with_name(f".{output.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    generation_config(tokenizer).save_pretrained(staging)
    (staging / "learning_curve.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    replace_directory(staging, output)
    run.finish("base", time.time() - start, output=str(output.resolve()), steps=trainer.state.global_step)
    print(f"base: saved {output}")


def generation_config(tokenizer) -> GenerationConfig:
    # As in Qwen's generation config: <|im_end|> ends a turn, and <|endoftext|> (the padding) ends it too.
    return GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=256,
        do_sample=False,
    )


def stage_convert(args, run: Run) -> None:
    start = time.time()
    converted = run.work / "converted"
    mask_token_id = AutoTokenizer.from_pretrained(args.base_output).mask_token_id
    command = [sys.executable, str(REPO / "scripts" / "convert_qwen3_5_moe.py"), "--input", args.base_output,
               "--output", str(converted), "--dtype", "float32", "--mask-token-id", str(mask_token_id), "--force"]  # fmt: skip
    subprocess.run(command, check=True)
    run.finish("convert", time.time() - start, output=str(converted.resolve()))


def stage_adapt(args, run: Run, resume: str | None) -> None:
    """scripts/train.py, the fine-tuning path users run, on the corpus the data stage wrote."""
    work, output = run.work, Path(args.output)
    adapted = work / "adapted"
    command = [
        sys.executable, str(REPO / "scripts" / "train.py"),
        "--model", str(work / "converted"), "--data", str(work / "train.jsonl"),
        "--eval-data", str(work / "eval.jsonl"), "--output", str(adapted), "--force",
        "--checkpoint-dir", str(work / "adapt"), "--save-steps", str(args.save_steps),
        "--max-steps", str(args.adapt_steps), "--batch-tokens", str(args.batch_tokens),
        "--lr", str(args.adapt_lr), "--lr-scheduler", "cosine", "--warmup-steps", str(max(1, args.adapt_steps // 50)), "--weight-decay", "0.01",
        "--noise-eps", str(args.noise_eps), "--causal-loss-weight", str(args.causal_loss_weight),
        "--eval-steps", str(args.save_steps), "--logging-steps", "25", "--seed", str(args.seed),
    ]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    if resume:
        command += ["--resume-from-checkpoint", resume]
    start = time.time()
    subprocess.run(command, check=True)

    staging = output.with_name(f".{output.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(adapted, staging)
    plot_learning_curves(Path(args.base_output) / "learning_curve.json", adapted / "learning_curve.json", staging)
    replace_directory(staging, output)
    run.finish("adapt", time.time() - start, output=str(output.resolve()), steps=args.adapt_steps)
    print(f"adapt: saved {output}")


def plot_learning_curves(base_log: Path, adapt_log: Path, output_dir: Path) -> None:
    """One plot of both stages: the base's next-token loss, then the adaptation's block-diffusion loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, adapt = json.loads(base_log.read_text()), json.loads(adapt_log.read_text())
    offset = max(entry.get("step", 0) for entry in base)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for log, shift, name, color in ((base, 0, "base (next-token)", "tab:blue"), (adapt, offset, "adaptation (block diffusion)", "tab:orange")):  # fmt: skip
        train = [(e["step"] + shift, e["loss"]) for e in log if "loss" in e]
        held_out = [(e["step"] + shift, e["eval_loss"]) for e in log if "eval_loss" in e]
        ax.plot(*zip(*train, strict=True), lw=0.8, color=color, label=f"{name}: training loss")
        if held_out:
            ax.plot(*zip(*held_out, strict=True), "o", ms=3, color=color, label=f"{name}: held-out loss")
    ax.axvline(offset, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per answer token")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Tiny demo: AR base, then conversion and block-diffusion adaptation")
    fig.tight_layout()
    fig.savefig(output_dir / "learning_curve.png", dpi=120)
    plt.close(fig)


def run_stages(args) -> None:
    """Runs the stages `args.stages` asks for, in order, skipping the finished ones (see the module docstring)."""
    architecture(args)  # a bad --layers is refused before anything is written
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Run(args)
    check_output(Path(args.base_output), run, "base", args.force)
    check_output(Path(args.output), run, "adapt", args.force)
    resume = args.resume_from
    if resume and not (Path(resume) / "trainer_state.json").is_file():  # refused before any stage runs
        raise ValueError(f"--resume-from {resume}: no Trainer checkpoint there (no trainer_state.json).")
    for stage in STAGES:
        if stage not in args.stages:
            continue
        missing = [s for s in STAGES[: STAGES.index(stage)] if not run.done(s)]
        if missing:
            raise ValueError(f"Stage {stage} needs {', '.join(missing)} first: run them (or all stages).")
        if run.done(stage):
            print(f"{stage}: done ({run.stages[stage]['seconds']} s), skipped")
            continue
        start = time.time()
        if stage == "data":
            stage_data(args, run)
            run.finish("data", time.time() - start)
        elif stage == "base":
            stage_base(args, run, resume)
        elif stage == "convert":
            stage_convert(args, run)
        else:
            stage_adapt(args, run, resume)
        resume = None  # --resume-from applies to the first stage that runs
