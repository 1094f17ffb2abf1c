"""Average the weights of several checkpoints of one model (a "model soup") into a new checkpoint.

    python scripts/average_weights.py --output runs/soup runs/a/adapted runs/b/adapted

Fine-tuning runs that start from the same weights end close to each other; their mean is often better than each of
them (Wortsman et al., 2022, "Model soups"). The checkpoints must have the same configuration (up to the version
of transformers that wrote it) and the same tensors; the output is the first checkpoint's directory (config,
tokenizer, code) with the mean of every tensor, computed in float32 and stored in each tensor's own dtype. It loads
with `AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clover.cli_clover import checkpoint_dir, run_main

WEIGHTS = "model.safetensors"
_UNCOMPARED = {"transformers_version"}  # config keys that do not change what the weights mean


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoint directories to average (two or more)")
    parser.add_argument("--output", required=True, type=Path, help="directory to write the averaged checkpoint into")
    parser.add_argument("--force", action="store_true", help="replace an existing, non-empty output directory")
    return parser.parse_args(argv)


def read_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return {key: value for key, value in config.items() if key not in _UNCOMPARED}


def check_inputs(models: list[Path]) -> None:
    """Refuses anything but two or more single-file checkpoints of one configuration and one set of tensors."""
    if len(models) < 2:
        raise ValueError(f"Got {len(models)} checkpoint; pass two or more checkpoint directories to average.")
    for path in models:
        if not (path / WEIGHTS).is_file():
            raise ValueError(f"{path} has no {WEIGHTS}: pass checkpoints saved in one safetensors file.")
    first_config = read_config(models[0])
    with safe_open(models[0] / WEIGHTS, "pt") as first:
        first_shapes = {name: first.get_slice(name).get_shape() for name in first.keys()}  # noqa: SIM118
    for path in models[1:]:
        config = read_config(path)
        differs = sorted(
            key for key in first_config.keys() | config.keys() if first_config.get(key) != config.get(key)
        )
        if differs:
            raise ValueError(
                f"{path} has another configuration than {models[0]} (differs in {', '.join(differs)}): only "
                "checkpoints of one model can be averaged."
            )
        with safe_open(path / WEIGHTS, "pt") as weights:
            shapes = {name: weights.get_slice(name).get_shape() for name in weights.keys()}  # noqa: SIM118
        if shapes != first_shapes:
            odd = sorted(
                name for name in first_shapes.keys() | shapes.keys() if first_shapes.get(name) != shapes.get(name)
            )
            raise ValueError(
                f"{path} has other tensors than {models[0]} (differs in {', '.join(odd[:3])}"
                f"{', ...' if len(odd) > 3 else ''}): only checkpoints of one model can be averaged."
            )


def average(models: list[Path]) -> dict[str, torch.Tensor]:
    """The mean of every tensor over `models`, summed in float32, in the first checkpoint's dtype."""
    handles = [safe_open(path / WEIGHTS, "pt") for path in models]
    averaged = {}
    for name in handles[0].keys():  # noqa: SIM118
        first = handles[0].get_tensor(name)
        total = first.float()
        for handle in handles[1:]:
            total = total + handle.get_tensor(name).float()
        averaged[name] = (total / len(models)).to(first.dtype).contiguous()
    return averaged


def main(argv=None) -> None:
    args = parse_args(argv)
    models = [checkpoint_dir(path, flag=None) for path in args.models]
    output = args.output
    if output.exists() and any(output.iterdir()) and not args.force:
        raise ValueError(f"{output} exists and is not empty; pass --force to replace it.")
    if any(output.resolve() == path.resolve() for path in models):
        raise ValueError(f"--output {output} is one of the checkpoints to average; write the average elsewhere.")
    check_inputs(models)
    weights = average(models)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as staging:
        staged = Path(staging) / "checkpoint"
        shutil.copytree(models[0], staged, ignore=shutil.ignore_patterns(WEIGHTS, "learning_curve.json"))
        save_file(weights, staged / WEIGHTS, metadata={"format": "pt"})
        sources = [str(path) for path in models]
        (staged / "averaged_from.json").write_text(json.dumps({"averaged_from": sources}, indent=1) + "\n")
        if output.exists():
            shutil.rmtree(output)
        staged.rename(output)  # whole or nothing: an existing output survives any failure before this line
    print(f"averaged {len(models)} checkpoints into {output}")


if __name__ == "__main__":
    run_main(main)
