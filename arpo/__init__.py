"""arpo: end-to-end reinforcement learning for vision-language GUI agents (ARPO)."""

__version__ = "0.1.0"
