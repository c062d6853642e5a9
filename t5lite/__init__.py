"""t5lite: a JAX sharding front-end for training transformers in the style of t5x / GSPMD."""

__version__ = "0.1.0"
