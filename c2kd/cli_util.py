"""Shared helpers for the command wrappers in `c2kd.cli`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.text import Text

from c2kd.errors import C2KDError

err_console = Console(stderr=True)


@contextmanager
def reporting_errors() -> Iterator[None]:
    """Turn a `C2KDError` into one red line on stderr and exit code 1 (no stack trace).

    Use as ``with reporting_errors(): ...`` or as a decorator ``@reporting_errors()`` placed
    under ``@app.command()``. Other exceptions are bugs and keep their traceback.
    """
    try:
        yield
    except C2KDError as error:
        message = " ".join(str(error).split()) or type(error).__name__
        err_console.print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
        raise typer.Exit(code=1) from None
