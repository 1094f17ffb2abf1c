"""`CloverTrainer`: `transformers.Trainer` for Clover's objective, with the token-weighted loss across processes,
decoding-state noise and per-layer learning rates; and Clover's LoRA targets."""

from __future__ import annotations

import re

import torch
from transformers import Trainer

from .generation_clover import select_positions_to_commit

# LoRA targets: every projection of the attention, Gated DeltaNet and shared expert layers, and the fused 3D experts,
# which are parameters, not nn.Linear (peft's `target_parameters`). The routers and gates stay frozen.
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj",
                "down_proj"]  # fmt: skip
LORA_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def clover_lora_config(rank: int, **overrides):
    """A peft `LoraConfig` over `LORA_MODULES` and `LORA_EXPERT_PARAMETERS`, alpha = 2 x rank, no dropout."""
    from peft import LoraConfig

    options = {"r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": LORA_MODULES}
    return LoraConfig(**(options | {"target_parameters": LORA_EXPERT_PARAMETERS} | overrides))


def supervised_weight(batch: dict) -> torch.Tensor:
    """The loss normaliser of a Clover batch: its supervised tokens, weighted by `label_weights` (the padding after
    an answer's EOS counts as one token), as `CloverForBlockDiffusion`'s loss divides by."""
    supervised = batch["labels"] != -100
    if batch.get("label_weights") is None:
        return supervised.sum().float()
    return batch["label_weights"].masked_fill(~supervised, 0).sum().float()


@torch.no_grad()
def decoding_state_noise(
    model,
    batch: dict,
    share: float,
    generator: torch.Generator | None = None,
    max_forwards: int = 4,
    threshold: float = 0.95,
    min_level: float = 0.1,
    keep_wrong_masked: bool = False,
) -> dict:
    """Replaces the noise of a `share` of the answer blocks by a state that LowConfidence decoding meets.

    Such a block starts all masked; then 1 to `max_forwards` forwards of `model` (drawn per block, no gradient)
    each unmask what the decoding rule would commit (every masked position whose most likely token has probability
    >= `threshold`, and at least the most confident one), writing the true token, as if decoding had been right so
    far. The loss then scores what is still masked, with the masked share of the block's supervised tokens (at
    least `min_level`) as its t. Uniform noise masks at random; these states keep masked what the model is least
    sure of, as decoding does. Measured on the demo model (README, the shipped tiny model): half the blocks so gave
    18 more points of addition at 0.95 than uniform noise over the same 250 steps. With `keep_wrong_masked`, a
    position the rule would commit with a wrong token stays masked (decoding would have committed the error), so
    the loss scores the confident mistakes that cost exact match below threshold 1, in the state that made them. (CloverTrainer draws the blocks
    from a generator seeded by the run's seed; a resumed run draws others.)

    Returns a new batch (the input is not changed); positions masked whatever the noise (the tail of
    `tail="mask"`) stay masked."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share ({share}) must lie in [0, 1]: the fraction of answer blocks in a decoding state.")
    if share == 0.0:
        return batch
    clover = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the LoRA layers stay
    config, block_size = clover.config, clover.config.block_size
    input_ids, labels, block_ids = batch["input_ids"], batch["labels"], batch["block_ids"]
    start = int((block_ids >= 0).any(dim=0).float().argmax())  # the answer columns (aligned across rows)
    supervised = (labels != -100)[:, start:]
    always = batch["noise_mask"][:, start:] & ~supervised
    rows, num_blocks = supervised.shape[0], supervised.shape[1] // block_size
    device = input_ids.device
    forwards = torch.randint(1, max_forwards + 1, (rows, num_blocks), generator=generator).to(device)
    chosen = torch.rand(rows, num_blocks, generator=generator).to(device) < share
    masked = supervised & chosen.repeat_interleave(block_size, dim=1)
    was_training = clover.training
    clover.eval()
    try:
        for forward in range(max_forwards):
            running = (forwards > forward).repeat_interleave(block_size, dim=1) & masked
            if not bool(running.any()):
                break
            noisy = torch.where(masked | always, config.mask_token_id, input_ids[:, start:])
            hidden = clover.model(
                input_ids=input_ids,
                attention_mask=batch.get("attention_mask"),
                block_ids=block_ids,
                noisy_input_ids=noisy,
                use_cache=False,
            ).last_hidden_state[:, input_ids.shape[1] :]
            logits = clover.lm_head(hidden[running]).float()
            logits[:, config.mask_token_id] = float("-inf")
            confidence = torch.full(masked.shape, -1.0, device=device)
            probability, candidate = logits.softmax(dim=-1).max(dim=-1)
            confidence[running] = probability
            commit = select_positions_to_commit(
                confidence.view(-1, block_size), running.reshape(-1, block_size), threshold
            ).view_as(masked)
            if keep_wrong_masked:  # commit only where the candidate is the true token
                commit[running] &= candidate == input_ids[:, start:][running]
            masked &= ~commit
    finally:
        clover.train(was_training)
    in_chosen = chosen.repeat_interleave(block_size, dim=1)
    counts = supervised.view(rows, num_blocks, block_size).sum(-1).clamp(min=1)
    level = (masked.view(rows, num_blocks, block_size).sum(-1) / counts).clamp(min=min_level)
    noise_mask, noise_level = batch["noise_mask"].clone(), batch["noise_level"].clone()
    noise_mask[:, start:] = torch.where(in_chosen, masked | always, noise_mask[:, start:])
    noise_level[:, start:] = torch.where(in_chosen, level.repeat_interleave(block_size, dim=1), noise_level[:, start:])
    return {**batch, "noise_mask": noise_mask, "noise_level": noise_level}


class CloverTrainer(Trainer):
    """`transformers.Trainer` whose training loss is the mean over the supervised tokens of the whole optimizer
    step: every micro-batch of the gradient accumulation on every process, not the mean of per-batch means.

    `CloverForBlockDiffusion` divides each batch's loss by that batch's (weighted) supervised tokens. Trainer
    divides by the accumulation steps and data parallelism averages over processes, so a batch with few tokens
    would weigh as much as one with many, and N processes with batch B would not train like one process with
    batch N x B. Here each batch's loss is rescaled by its share of the step's weighted tokens, summed over
    processes (Trainer's `num_items_in_batch` count, weighted like the model's loss): the gradient is then that of
    one batch holding all of them, whatever the number of processes and accumulation steps. The router's
    auxiliary loss, a statistic of each batch, is averaged with the same weights.
    """

    def __init__(
        self,
        *args,
        decoding_state_share: float = 0.0,
        decoding_state_keep_wrong: bool = False,
        layer_learning_rates: dict[int, float] | None = None,
        **kwargs,
    ):
        """`decoding_state_share`: the fraction of answer blocks trained in a state LowConfidence decoding meets
        instead of under the collator's noise (`decoding_state_noise`; training steps only);
        `decoding_state_keep_wrong`: in those states a position the rule would commit wrongly stays masked;
        `layer_learning_rates`: {layer index: peak learning rate} for decoder layers that should not train at
        `args.learning_rate` (say, layers just added to a trained model); the schedule scales every rate alike."""
        super().__init__(*args, **kwargs)
        if not 0.0 <= decoding_state_share <= 1.0:
            raise ValueError(f"decoding_state_share ({decoding_state_share}) must lie in [0, 1].")
        self.decoding_state_share = decoding_state_share
        self.decoding_state_keep_wrong = decoding_state_keep_wrong
        self.layer_learning_rates = dict(layer_learning_rates or {})
        num_layers = self.accelerator.unwrap_model(self.model).config.num_hidden_layers
        unknown = sorted(i for i in self.layer_learning_rates if not 0 <= i < num_layers)
        if unknown:
            raise ValueError(
                f"layer_learning_rates names layers {unknown}, but the model has layers 0-{num_layers - 1}."
            )
        self._decoding_state_generator = torch.Generator().manual_seed(self.args.seed)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return batch_samples, None
        total = sum(supervised_weight(batch) for batch in batch_samples).to(device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return batch_samples, total

    def create_optimizer(self, *args, **kwargs):
        """Trainer's optimizer, each parameter group split by `layer_learning_rates` (made before any step, so
        there is no state to move; a resumed run with the same rates finds the same groups)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if not self.layer_learning_rates:
            return optimizer
        rate_of = {}
        for name, parameter in self.model.named_parameters():
            found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if found and int(found.group(1)) in self.layer_learning_rates:
                rate_of[id(parameter)] = self.layer_learning_rates[int(found.group(1))]
        groups = []
        for group in optimizer.param_groups:
            by_rate: dict[float, list] = {}
            for parameter in group["params"]:
                by_rate.setdefault(rate_of.get(id(parameter), group["lr"]), []).append(parameter)
            groups.extend({**group, "params": params, "lr": rate} for rate, params in by_rate.items())
        optimizer.param_groups = groups
        return optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        # transformers 5.2 loads a resumed optimizer with map_location=args.device, which is "cpu:0" on several CPU
        # processes, a location torch.load has no deserializer for: give it one (an indexed CPU is the CPU).
        if checkpoint is not None and self.args.device.type == "cpu" and self.args.world_size > 1:
            _accept_indexed_cpu_locations()
        return super()._load_optimizer_and_scheduler(checkpoint)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.decoding_state_share and model.training and "noise_mask" in inputs:
            unwrapped = self.accelerator.unwrap_model(model)
            inputs = decoding_state_noise(
                unwrapped,
                inputs,
                self.decoding_state_share,
                self._decoding_state_generator,
                keep_wrong_masked=self.decoding_state_keep_wrong,
            )
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if num_items_in_batch is not None:  # training: Trainer then divides by the accumulation steps
            share = supervised_weight(inputs).to(loss.device) / num_items_in_batch.clamp(min=1e-6)
            loss = loss * share * self.accelerator.num_processes * self.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss


_INDEXED_CPU_REGISTERED = []


def _accept_indexed_cpu_locations() -> None:
    if not _INDEXED_CPU_REGISTERED:
        torch.serialization.register_package(
            11, lambda storage: None, lambda obj, location: obj if location.startswith("cpu:") else None
        )
        _INDEXED_CPU_REGISTERED.append(True)


__all__ = [
    "LORA_EXPERT_PARAMETERS",
    "LORA_MODULES",
    "CloverTrainer",
    "clover_lora_config",
    "decoding_state_noise",
    "supervised_weight",
]
