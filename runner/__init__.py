"""approx-run: an experiment runner for approximate 8-bit multipliers in neural networks."""

__version__ = "0.1.0"
