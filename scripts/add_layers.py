"""Deepen a checkpoint: append copies of some of its layers whose writes into the residual stream start at zero, so
the deeper model computes exactly what the original does, and further training puts the new depth to use (block
expansion, as in LLaMA Pro).

    python scripts/add_layers.py --model models/clover-tiny-demo --copy 2 3 --output runs/clover-6-layers
    python scripts/add_layers.py --model models/qwen3_5_moe-tiny-demo --copy 2 3 --output runs/base-6-layers

Works on Clover checkpoints and on transformers' Qwen3.5-MoE text checkpoints (they share the parameter names). Each
copy keeps its layer's type (Gated DeltaNet or full attention) and weights, except the projections that write into
the residual stream, which start at zero: `self_attn.o_proj` or `linear_attn.out_proj`, and the down projections
of the routed and the shared experts. The copies go after the last layer, in the order given. The script checks that
the deeper model's logits equal the original's before it writes the output (atomically).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from clover.cli_clover import checkpoint_dir, run_main

WEIGHTS = "model.safetensors"
# The parameters through which a layer writes into the residual stream: zero, and the layer adds nothing. Every
# down projection of its MLP: the routed experts (fused `experts.down_proj`, or `experts.N.down_proj.weight` as
# transformers saves them) and the shared expert.
ATTENTION_WRITES = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight")


def writes_residual(name: str) -> bool:
    return name.endswith(ATTENTION_WRITES) or (".mlp." in name and "down_proj" in name.rsplit(".mlp.", 1)[1])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Clover or Qwen3.5-MoE checkpoint directory")
    parser.add_argument(
        "--copy", type=int, nargs="+", required=True, metavar="LAYER", help="layers to append copies of"
    )
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--force", action="store_true", help="replace an existing, non-empty output directory")
    return parser.parse_args(argv)


def text_config(config: dict) -> dict:
    """The part of config.json that describes the layers (a multimodal config nests it under text_config)."""
    return config.get("text_config", config)


def deepen(config: dict, weights: dict[str, torch.Tensor], copies: list[int]) -> tuple[dict, dict]:
    """The config and weights with `copies` appended as new layers (residual writes zeroed)."""
    config = json.loads(json.dumps(config))
    layers = text_config(config)
    num_layers = layers["num_hidden_layers"]
    bad = [index for index in copies if not 0 <= index < num_layers]
    if bad:
        raise ValueError(f"--copy {bad}: the model has layers 0-{num_layers - 1}; name layers in that range.")
    prefixes = {name[: name.index(".layers.")] for name in weights if ".layers." in name}
    if len(prefixes) != 1:
        raise ValueError(f"Expected the layers under one prefix (model.layers.N), found {sorted(prefixes)}.")
    prefix = prefixes.pop() + ".layers."
    weights = dict(weights)
    for offset, source in enumerate(copies):
        own, new = f"{prefix}{source}.", f"{prefix}{num_layers + offset}."
        for name in [name for name in weights if name.startswith(own)]:
            tensor = weights[name]
            copied = torch.zeros_like(tensor) if writes_residual(name) else tensor.clone()
            weights[new + name[len(own) :]] = copied
        layers["layer_types"].append(layers["layer_types"][source])
    layers["num_hidden_layers"] = num_layers + len(copies)
    return config, weights


def check_same_function(original: Path, deeper: Path) -> float:
    """Max |logit difference| of the two checkpoints on a fixed random input; raises if they differ."""
    torch.manual_seed(0)
    models = [AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).float().eval() for path in (original, deeper)]  # fmt: skip
    input_ids = torch.randint(0, models[0].config.vocab_size - 1, (1, 48))
    with torch.no_grad():
        first, second = (model(input_ids).logits for model in models)
    difference = float((first - second).abs().max())
    if difference > 1e-3:
        raise RuntimeError(f"The deepened model's logits differ from the original's by {difference:.2e}.")
    return difference


def main(argv=None) -> None:
    args = parse_args(argv)
    model, output = checkpoint_dir(args.model), args.output
    if output.exists() and any(output.iterdir()) and not args.force:
        raise ValueError(f"{output} exists and is not empty; pass --force to replace it.")
    if output.resolve() == model.resolve():
        raise ValueError(f"--output {output} is the --model directory; write the deeper model elsewhere.")
    if not (model / WEIGHTS).is_file():
        raise ValueError(f"{model} has no {WEIGHTS}: pass a checkpoint saved in one safetensors file.")
    config, weights = deepen(json.loads((model / "config.json").read_text()), load_file(model / WEIGHTS), args.copy)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as staging:
        staged = Path(staging) / "checkpoint"
        shutil.copytree(model, staged, ignore=shutil.ignore_patterns(WEIGHTS, "learning_curve.*"))
        save_file(weights, staged / WEIGHTS, metadata={"format": "pt"})
        (staged / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        difference = check_same_function(model, staged)
        if output.exists():
            shutil.rmtree(output)
        staged.rename(output)  # whole or nothing: an existing output survives any failure before this line
    layers = text_config(config)["num_hidden_layers"]
    print(
        f"{output}: {layers} layers (copies of {args.copy} appended); logits equal to {model}'s within {difference:.1e}"
    )


if __name__ == "__main__":
    run_main(main)
