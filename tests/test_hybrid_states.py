"""Verify-pass states of the hybrid target: committing a per-position state equals having decoded only
the accepted tokens, for chains and for trees (each node continues from its parent's state)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_helpers import ATOL, full_pass, ids, loaded, prefill, run
from jspec.models import hybrid as H

FAMILY = "qwen3_next"  # MoE and three GDN layers per block: the most recurrent state per token


def _seq(x, r, n, *rest):
    """Row r's first n prompt tokens followed by the given token lists."""
    out = list(x[r, :n])
    for part in rest:
        out += list(part)
    return out


def test_chain_commit_then_continue_equals_decoding_only_the_accepted_tokens():
    cfg, params = loaded(FAMILY)
    x = ids(2, 24, seed=5)
    lengths = np.array([12, 9])
    _, cache = prefill(cfg, params, x, lengths)
    block = ids(2, 6, seed=6)  # [anchor, 5 drafts] per row
    pos = lengths[:, None] + np.arange(6)[None]
    lg_v, out = run(cfg, params, block, pos, cache, keep_states=True)
    # The verify pass leaves the committed recurrent state alone and returns one state per token.
    np.testing.assert_array_equal(np.asarray(out.cache.ssm), np.asarray(cache.ssm))
    np.testing.assert_array_equal(np.asarray(out.cache.conv), np.asarray(cache.conv))
    assert len(out.states.ssm) == len(out.states.conv) == cfg.counts["gdn"]  # one entry per GDN layer
    for ssm in out.states.ssm:
        assert ssm.shape == (2, 6, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        assert ssm.dtype == jnp.float32
    ref, _ = full_pass(cfg, params, [_seq(x, r, lengths[r], block[r]) for r in range(2)])
    for r in range(2):
        np.testing.assert_allclose(lg_v[r], ref[r, lengths[r] : lengths[r] + 6], atol=ATOL, rtol=0)

    cont = ids(2, 4, seed=7)
    for index in ([0, 5], [3, 1]):  # accepted length n per row: keep the state after token n
        index = np.array(index)
        committed = H.commit_states(out.cache, out.states, jnp.asarray(index))
        start = lengths + index + 1
        cpos = start[:, None] + np.arange(4)[None]
        lg_c, _ = run(cfg, params, cont, cpos, committed)
        ref, _ = full_pass(cfg, params, [_seq(x, r, lengths[r], block[r, : index[r] + 1], cont[r]) for r in range(2)])
        for r in range(2):
            np.testing.assert_allclose(lg_c[r], ref[r, start[r] : start[r] + 4], atol=ATOL, rtol=0,
                                       err_msg=f"row {r} index {index[r]}")


def _ancestors(parent: np.ndarray) -> np.ndarray:
    n = len(parent)
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        j = parent[i]
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    return anc


def _path(parent: np.ndarray, t: int) -> list[int]:
    out = [t]
    while parent[out[-1]] >= 0:
        out.append(parent[out[-1]])
    return out[::-1]


def test_tree_nodes_follow_their_root_paths_and_commit():
    cfg, params = loaded(FAMILY)
    x = ids(2, 24, seed=8)
    lengths = np.array([11, 8])
    _, cache = prefill(cfg, params, x, lengths)
    parent = np.array([[-1, 0, 0, 1, 1, 3], [-1, -1, 0, 1, 2, 4]])
    depth = np.array([[len(_path(p, t)) - 1 for t in range(6)] for p in parent])
    nodes = ids(2, 6, seed=9)
    tree_mask = np.stack([_ancestors(p) for p in parent])
    lg_t, out = run(cfg, params, nodes, lengths[:, None] + depth, cache, ctx_len=lengths,
                    cache_rows=lengths[:, None] + np.arange(6)[None], tree_mask=tree_mask, parent=parent,
                    keep_states=True)
    for t in range(6):  # node t of both rows: a sequential pass along its root path
        paths = [_path(parent[r], t) for r in range(2)]
        ref, _ = full_pass(cfg, params, [_seq(x, r, lengths[r], nodes[r, paths[r]]) for r in range(2)])
        for r in range(2):
            np.testing.assert_allclose(lg_t[r, t], ref[r, lengths[r] + len(paths[r]) - 1], atol=ATOL, rtol=0,
                                       err_msg=f"row {r} node {t}")

    # Accept the path to node 5 in both rows: compact its K/V rows, commit its state, continue.
    paths = [_path(parent[r], 5) for r in range(2)]
    rows = np.arange(2)[:, None]
    src = np.array([lengths[r] + np.array(paths[r]) for r in range(2)])
    dst = lengths[:, None] + np.arange(src.shape[1])[None]
    move = lambda x: x.at[rows, :, dst].set(x[rows, :, src])  # each attention layer's [B, Hkv, S, Dh] buffer
    committed = dataclasses.replace(out.cache, k=tuple(map(move, out.cache.k)), v=tuple(map(move, out.cache.v)))
    committed = H.commit_states(committed, out.states, jnp.array([5, 5]))
    cont = ids(2, 4, seed=10)
    start = lengths + src.shape[1]
    lg_c, _ = run(cfg, params, cont, start[:, None] + np.arange(4)[None], committed)
    ref, _ = full_pass(cfg, params, [_seq(x, r, lengths[r], nodes[r, paths[r]], cont[r]) for r in range(2)])
    for r in range(2):
        np.testing.assert_allclose(lg_c[r], ref[r, start[r] : start[r] + 4], atol=ATOL, rtol=0)


def test_reset_recurrent_zeroes_only_the_given_rows():
    cfg, _ = loaded(FAMILY)
    cache = H.HybridCache.zeros(cfg, 3, 8)
    cache = jax.tree_util.tree_map(lambda x: x + 1, cache)
    out = H.reset_recurrent(cache, jnp.array([False, True, False]))
    for state in out.ssm + out.conv:
        assert float(state[1].max()) == 0 and float(state[0].min()) == 1 and float(state[2].min()) == 1
    for a, b in zip(out.k + out.v, cache.k + cache.v, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tree_mask=np.ones((1, 2, 2), bool)), "also needs parent"),
        (dict(parent=np.array([[-1, 0]])), "only meaningful with keep_states"),
        (dict(lengths=np.array([2]), keep_states=True), "cannot be combined with keep_states"),
        (dict(gdn_impl="chunked", keep_states=True), "needs the recurrent GDN form"),
        (dict(taps=(7,)), r"tap layers \[7\] outside"),
    ],
)
def test_bad_forward_arguments_fail_before_compiling(kwargs, match):
    cfg, params = loaded(FAMILY)
    with pytest.raises(ValueError, match=match):
        H.forward(params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                  H.HybridCache.zeros(cfg, 1, 8), **kwargs)


def test_per_position_state_bytes_for_a_qwen3_next_80b_shaped_model():
    """The cost of the per-position commit strategy, read off abstract shapes (nothing is allocated)."""
    cfg = H.HybridConfig.from_hf_dict(dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}))
    assert cfg.counts == {"attn": 12, "gdn": 36, "mlp": 0, "moe": 48} and 79e9 < cfg.num_params < 81e9
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), H.param_shapes(cfg),
                                    is_leaf=lambda s: isinstance(s, tuple))
    cache = jax.eval_shape(lambda: H.HybridCache.zeros(cfg, 1, 64, jnp.bfloat16))
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    out = jax.eval_shape(lambda p, c, t: H.forward(p, cfg, t, t, c, keep_states=True), params, cache, tokens)
    assert len(out.states.conv) == len(out.states.ssm) == 36
    conv, ssm = out.states.conv[0], out.states.ssm[0]
    assert conv.shape == (1, 16, 3, 8192) and conv.dtype == jnp.bfloat16
    assert ssm.shape == (1, 16, 32, 128, 128) and ssm.dtype == jnp.float32
    per_layer_row = conv.size * 2 + ssm.size * 4
    assert per_layer_row == 34_340_864  # 16 x (2 MiB of S + 48 KiB of window): 32.75 MiB
