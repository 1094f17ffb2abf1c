"""Fine-tuning Clover with TRL (`pip install "clover[trl]"`): `CloverSFTTrainer`, TRL's `SFTTrainer` set up for
block diffusion.

Plain `trl.SFTTrainer` already trains Clover's objective: TRL asks the model for per-token terms with
`fused_lm_head=True`, and Clover answers with the block-diffusion objective's (its forward lays out every
supervised run of the labels as an answer in blocks; docs/DESIGN.md §7) instead of taking TRL's next-token head.
`CloverSFTTrainer` adds what a user of that trainer would otherwise have to know:

* chat datasets (`"messages"`) are trained on the assistant replies only (`assistant_only_loss`): a whole
  conversation supervised would have Clover learn to write the user's turns as answers;
* a `peft_config` without `target_modules` gets Clover's LoRA targets, the fused 3D experts included
  (`trainer_clover.LORA_MODULES` / `LORA_EXPERT_PARAMETERS`);
* packed or padding-free batches are refused: each answer must sit in blocks right after its own prompt;
* so are a `compute_loss_func` and label smoothing, which would read logits the objective does not build.
"""

from __future__ import annotations

import dataclasses

from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from .trainer_clover import LORA_EXPERT_PARAMETERS, LORA_MODULES

logger = logging.get_logger(__name__)


class CloverSFTTrainer(SFTTrainer):
    """`trl.SFTTrainer` for Clover checkpoints; takes the same arguments (see the module docstring for what it sets)."""

    def __init__(self, model, args: SFTConfig | None = None, *positional, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = SFTConfig(f"{str(name).rstrip('/').split('/')[-1] or 'clover'}-SFT")
        _refuse_what_the_objective_cannot_do(args, kwargs)
        dataset = kwargs.get("train_dataset", positional[1] if len(positional) > 1 else None)
        if dataset is not None and _is_chat(dataset) and not args.assistant_only_loss:
            logger.info("Chat dataset: training on the assistant replies only (assistant_only_loss=True).")
            args = dataclasses.replace(args, assistant_only_loss=True)
        peft_config = kwargs.get("peft_config")
        if peft_config is not None and getattr(peft_config, "target_modules", None) is None:
            peft_config.target_modules = LORA_MODULES
            peft_config.target_parameters = peft_config.target_parameters or LORA_EXPERT_PARAMETERS
        super().__init__(model, args, *positional, **kwargs)


def _refuse_what_the_objective_cannot_do(args: SFTConfig, kwargs: dict) -> None:
    if args.packing or args.padding_free:
        raise ValueError(
            f"packing={args.packing}, padding_free={args.padding_free}: Clover lays each answer out in blocks after its "
            "own prompt, which a packed batch cannot express. Set packing=False and padding_free=False in SFTConfig."
        )
    if kwargs.get("compute_loss_func") is not None or args.label_smoothing_factor:
        raise ValueError(
            "compute_loss_func and label_smoothing_factor replace the loss by one computed from next-token logits; "
            "Clover's loss is its block-diffusion objective, computed by the model. Leave both unset."
        )


def _is_chat(dataset) -> bool:
    """A conversational language-modeling dataset (`"messages"`), whose every message TRL would supervise."""
    columns = getattr(dataset, "column_names", None) or []
    return "messages" in columns and "completion" not in columns


__all__ = ["CloverSFTTrainer"]
