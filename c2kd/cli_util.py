"""Shared helpers for the command wrappers in `c2kd.cli`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.text import Text

from c2kd.errors import C2KDError

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import ClickException, NoArgsIsHelpError

err_console = Console(stderr=True)

MAX_COUNT = 2**63 - 1  # the largest count an option takes: beyond it numpy and polars overflow


def within_64_bits(value: int | None) -> int | None:
    """The callback of a count option: a number numpy and polars can hold (None: not given)."""
    if value is not None and abs(value) > MAX_COUNT:
        raise typer.BadParameter(f"{value} is beyond the largest count, {MAX_COUNT}")
    return value


def finite_float(text: str) -> float:
    """The value of a float option; nan and inf are refused (a NaN loss weight trains a NaN model)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


@contextmanager
def reporting_errors() -> Iterator[None]:
    """Turn a `C2KDError` into one red line on stderr and exit code 1 (no stack trace).

    Use as ``with reporting_errors(): ...`` or as a decorator ``@reporting_errors()`` placed
    under ``@app.command()``. Other exceptions are bugs and keep their traceback.
    """
    try:
        yield
    except C2KDError as error:
        one_line_error(str(error) or type(error).__name__)
        raise typer.Exit(code=1) from None


def one_line_error(message: str) -> None:
    """`error: <message>` as one line on stderr (whitespace and newlines collapsed)."""
    err_console.print(Text(f"error: {' '.join(message.split())}", style="bold red"), soft_wrap=True)
