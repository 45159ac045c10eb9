"""jspec: lossless speculative decoding with parallel drafters in JAX."""

from jspec._version import __version__
from jspec.api import GenerateResult, Target, generate, load_drafter, load_target
from jspec.models.config import ModelConfig
from jspec.verify.sampling import SamplingParams

__all__ = ["__version__", "GenerateResult", "ModelConfig", "SamplingParams", "Target", "generate", "load_drafter", "load_target"]
