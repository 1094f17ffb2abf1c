"""Copies the package's code files into a Clover checkpoint directory (default: the shipped demo model).

    python scripts/sync_model_code.py [DIR ...]

A checkpoint runs its own copy of the code files (`clover.conversion_clover.CODE_FILES`) under trust_remote_code;
after changing the package, refresh the copies so the checkpoint runs the new code.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from clover.cli_clover import checkpoint_dir, run_main
from clover.conversion_clover import CODE_FILES

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    targets = [Path(a) for a in (sys.argv[1:] if argv is None else argv)] or [REPO / "models" / "clover-tiny-demo"]
    for target in targets:
        checkpoint_dir(target, flag=None)
        for name in CODE_FILES:
            shutil.copyfile(REPO / name, target / name)
        print(f"updated {target}")


if __name__ == "__main__":
    run_main(main)
