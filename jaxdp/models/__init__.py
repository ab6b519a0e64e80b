"""Reference models trained by jaxdp's main job (plain flax linen layers)."""

from .gpt import ATTENTION as ATTENTION
from .gpt import GPT as GPT
from .gpt import GPTConfig as GPTConfig
from .gpt import attention_implementation as attention_implementation
from .gpt import generate as generate
from .gpt import next_byte_loss as next_byte_loss

__all__ = [
    "ATTENTION",
    "GPT",
    "GPTConfig",
    "attention_implementation",
    "generate",
    "next_byte_loss",
]
