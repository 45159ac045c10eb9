"""Verification rules and the sampling/noise primitives they share with the decode loop."""

from jspec.verify import noise
from jspec.verify.sampling import SamplingParams, gumbel_argmax, served_logprobs, validate_sampling

__all__ = ["SamplingParams", "gumbel_argmax", "noise", "served_logprobs", "validate_sampling"]
