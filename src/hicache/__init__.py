"""hicache: an LLM serving engine built around a hierarchical KV cache."""

__version__ = "0.1.0"
