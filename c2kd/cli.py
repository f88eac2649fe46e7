"""The `c2kd` command line."""

from __future__ import annotations

import typer

app = typer.Typer(help="c2kd: distil an LLM recommender into a small on-device one (C2KD).", no_args_is_help=True)
cache_app = typer.Typer(help="Inspect and check a teacher cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

# Each section below holds the thin command wrappers of one module; the work lives in the module.

# --- data: prepare ---

# --- sasrec: train-sasrec ---

# --- evaluate ---

# --- recommender LM: train-teacher ---

# --- stage one: cache-teacher ---

# --- cache: info / verify ---

# --- stage two: distill ---

# --- demo ---


if __name__ == "__main__":
    app()
