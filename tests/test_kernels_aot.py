"""The Pallas kernels compile for real chips at Qwen3-8B / DFlash-b16 shape, without a device.

Each case runs `python -m jspec.benchmarks.kernels --aot CHIP` in a subprocess under the AOT
interpreter (.venv-aot/bin/python, or $JSPEC_AOT_PYTHON: jax plus libtpu and the CUDA plugin) with
`jspec.aot.devices.aot_env(CHIP)`: a full compile through Mosaic (TPU: VMEM allocation against the
chip's scoped limit) or Triton + XLA:GPU (H200: shared memory per block, element limits), the same
checks a device would make before running. Shape: hidden 4096, 32 q / 8 kv heads x 128, MLP 12288,
block 16, context 4096, tree of 33 nodes, batch 1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jspec.aot.devices import aot_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def aot_python() -> str:
    path = os.environ.get("JSPEC_AOT_PYTHON") or str(ROOT / ".venv-aot" / "bin" / "python")
    if not os.access(path, os.X_OK):
        pytest.fail(f"the deviceless compile tests need the AOT interpreter at {path} (jax with libtpu==0.0.42.1 "
                    "and jax-cuda12-plugin/pjrt==0.10.2), which is missing: build it (`make .venv-aot/.done`) or "
                    "point JSPEC_AOT_PYTHON at one", pytrace=False)
    return path


def compile_rows(tmp_path, chip: str, dtype: str, reference: bool = False, jax_ops: bool = False) -> dict:
    """{(kernel, impl): row} from one subprocess compiling both kernels (and their references, and on a TPU
    with jax_ops JAX's own ragged paged attention)."""
    out = tmp_path / "rows.json"
    env = {**os.environ, **aot_env(chip), "PYTHONPATH": str(ROOT)}
    cmd = [aot_python(), "-m", "jspec.benchmarks.kernels", "--aot", chip, "--aot-dtypes", dtype, "--json", str(out)]
    if not reference:
        cmd.append("--no-reference")
    if jax_ops:
        cmd.append("--jax-ops")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return {(r["kernel"], r["impl"]): r for r in json.loads(out.read_text())}


def assert_compiled(rows: dict, impl: str) -> None:
    for kernel in ("draft", "tree"):
        row = rows[kernel, impl]
        assert "error" not in row, f"{row['chip']} {kernel} {row['dtype']}: {row['error']}"
        assert row["custom_calls"] >= 1, row  # the Pallas kernels are in the compiled program
        # Each kernel reads what the call's inputs hold, about once (tree attention reads the target's
        # [B, Hkv, S, Dh] cache in place, with no relayout copy).
        assert row["bytes"] <= 1.2 * row["floor"], row


@pytest.mark.parametrize("chip, dtype", [
    ("tpu-v5p", "bfloat16"),
    ("tpu-v5p", "float32"),
    pytest.param("tpu-v5e", "bfloat16", marks=pytest.mark.slow),
    pytest.param("tpu-v6e", "bfloat16", marks=pytest.mark.slow),
])
def test_tpu_kernels_compile(tmp_path, chip, dtype):
    """Also JAX's own `ragged_paged_attention` on the chain verify pass it fits (same rows and context, in
    its paged layout): it compiles too and reads its inputs once, the comparison the README reports."""
    rows = compile_rows(tmp_path, chip, dtype, jax_ops=True)
    assert_compiled(rows, "tpu")
    ragged = rows["tree", "jax-ragged"]
    assert "error" not in ragged and ragged["custom_calls"] == 1, ragged
    assert ragged["bytes"] <= 1.05 * ragged["floor"], ragged


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_h200_kernels_compile(tmp_path, dtype):
    assert_compiled(compile_rows(tmp_path, "h200", dtype), "portable")


def test_h200_kernels_move_fewer_bytes_than_the_reference(tmp_path):
    """From the compiled HLO: the GPU kernels stay within 1% (draft) / 15% (tree) of the bytes of their
    inputs and output, below what XLA's fusions of the reference move."""
    rows = compile_rows(tmp_path, "h200", "bfloat16", reference=True)
    assert_compiled(rows, "portable")
    for kernel in ("draft", "tree"):
        assert rows[kernel, "portable"]["bytes"] < rows[kernel, "reference"]["bytes"], (kernel, rows)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
