"""The benchmark suite: one script per measurement, shared helpers in `common`, results in `results/<script>/`.

Run a script as `python benchmarks/NAME.py` or `python -m benchmarks.NAME`; `python benchmarks/run.py` runs the suite.
"""
