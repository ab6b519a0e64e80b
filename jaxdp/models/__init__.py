"""Reference models trained by jaxdp's main job (plain flax linen layers)."""

from .gpt import GPT as GPT
from .gpt import GPTConfig as GPTConfig
from .gpt import generate as generate
from .gpt import next_byte_loss as next_byte_loss

__all__ = ["GPT", "GPTConfig", "generate", "next_byte_loss"]
