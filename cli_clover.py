"""What the command-line scripts share: a user error ends the script like a command-line tool, not a traceback."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

USAGE_ERROR = 2  # the exit status argparse gives a bad argument; a bad input value is the same kind of error


def run_main(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> None:
    """Runs a script's `main(argv)`; a ValueError (bad arguments or input, raised with the fix in its message)
    becomes one line on stderr and exit status 2."""
    try:
        main(argv)
    except ValueError as error:
        message = " ".join(str(error).split())  # one line, whatever the message's own line breaks
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None


def checkpoint_dir(path: str | os.PathLike, flag: str | None = "--model") -> Path:
    """`path` as a checkpoint directory (it holds a config.json), or a ValueError saying what to pass instead."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = f"{flag} DIR, a checkpoint directory" if flag else "a checkpoint directory"
        raise ValueError(f"No checkpoint at {path} (no config.json there): pass {what}.")
    return path


def repository_label(path: str | os.PathLike) -> str:
    """A path as results files name it: relative to the repository when it lies inside it, else as given."""
    resolved, repository = Path(path).resolve(), Path(__file__).resolve().parent
    return str(resolved.relative_to(repository)) if resolved.is_relative_to(repository) else str(path)


def replace_directory(staging: Path, output: Path) -> None:
    """Puts the complete directory `staging` at `output` (same filesystem: renames, no copies). An existing output
    is first renamed aside (`.NAME.replaced-PID` beside it) and deleted only once the new one is in place; a failed
    swap moves it back. Killed at any point, the old model is at `output` or beside it, never gone."""
    output.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if output.is_dir() and not output.is_symlink() and not any(output.iterdir()):
        output.rmdir()
    elif output.exists() or output.is_symlink():
        old = output.with_name(f".{output.name}.replaced-{os.getpid()}")
        output.rename(old)
    try:
        staging.rename(output)
    except BaseException:
        if old is not None:
            old.rename(output)
        raise
    if old is not None and old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old is not None:
        old.unlink()


__all__ = ["USAGE_ERROR", "checkpoint_dir", "replace_directory", "repository_label", "run_main"]
