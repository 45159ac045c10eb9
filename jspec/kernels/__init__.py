"""Pallas kernels for the drafter's hot path, each beside its pure-jnp reference.

- `draft_layer` (jspec.kernels.draft): one fused DFlash draft layer (norm, QKV, q/k norm, RoPE,
  attention over [context window ; block], o_proj + residual; then the SwiGLU half); reference
  `ref_draft_layer`. `draft_stack` runs a drafter's whole layer stack with it.
- `tree_attention` (jspec.kernels.tree): tree nodes over the committed cache plus an
  ancestor bitmask among the nodes; reference `ref_tree_attention`; `pack_bits` builds the bitmask.
- `q4_matmul` (jspec.kernels.q4): x @ W.T for an affine Q4 group-64 matrix (`jspec.models.quant.Q4`),
  each weight tile dequantized on chip; reference `quant._reference_matmul`. Importing jspec.kernels
  registers it as the Q4 matmul "pallas" (`quant.with_kernel(params, "pallas")`).

Selection: `kernels` / `attention` flags take "reference" | "pallas" | "auto" (`resolve`: "auto" is
"pallas" on TPU, "reference" on CPU and on GPU, where XLA's fusions measured faster; the Q4 matmul's
"auto" is "pallas" on TPU and GPU). "pallas" picks the implementation for the backend
(`pallas_setup`): the Mosaic TPU kernels on TPU, the portable `pallas_call` kernels on GPU (lowered
through Triton; power-of-two hidden size / head_dim), and on CPU the TPU kernels in interpret mode
(for tests). Where used: `DFlash(kernels=...)` / `dflash.draft_blocks(kernels=...)` for the draft
layers, `transformer.forward(attention=...)` (`DecodeConfig.attention`) for the target's decode, chain and
tree verification passes.
"""

from jspec.kernels._backend import KERNELS, pallas_setup, resolve, use_pallas
from jspec.kernels.draft import draft_layer, draft_stack, ref_draft_layer
from jspec.kernels.q4 import q4_matmul
from jspec.kernels.tree import pack_bits, ref_tree_attention, tree_attention, unpack_bits

__all__ = [
    "KERNELS", "draft_layer", "draft_stack", "pack_bits", "pallas_setup", "q4_matmul", "ref_draft_layer",
    "ref_tree_attention", "resolve", "tree_attention", "unpack_bits", "use_pallas",
]
