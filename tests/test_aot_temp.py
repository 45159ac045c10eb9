"""jspec.aot.temp: temp memory split into data and the compiler's slots, from a buffer-assignment dump."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jspec.aot import temp

# The layout of XLA:TPU's dump, shortened: arrays at the bottom of the main-memory block, a tuple table
# above them, a scalar of a reduction computation and a constant in allocations of their own, and a
# block in another memory (color 1) that main-memory temp does not count.
TPU_LIKE = """BufferAssignment:
allocation 0: size 1024, parameter 0, shape |bf16[512]| at ShapeIndex {}:
 value: <1 p.1 @0> (size=1024,offset=0): bf16[512]{0}
allocation 1: size 512, thread-local:
 value: <2 reduce_sum.3 @0> (size=512,offset=0): f32[]{:T(128)}
allocation 2: size 512, constant:
 value: <3 constant.7 @0> (size=512,offset=0): s32[]{:T(128)}
allocation 3: size 65536, color 1, preallocated-temp:
 value: <4 fusion.9 @0> (size=65536,offset=0): f32[16384]{0}
allocation 4: size 40960, preallocated-temp:
 value: <5 fusion.1 @0> (size=4096,offset=0): f32[1024]{0}
 value: <6 fusion.2 @0> (size=4096,offset=4096): f32[1024]{0}
 value: <7 copy-start.4{} @0> (size=24,offset=24576): (f32[1024]{0}, f32[1024]{0}, u32[]{:S(2)})
 value: <8 while.2{} @0> (size=16,offset=8192): (s32[]{:T(128)}, f32[1024]{0})
"""


def test_a_tpu_style_block_splits_into_arrays_and_tables():
    allocations = temp.parse(TPU_LIKE)
    assert [(a["kind"], a["color"]) for a in allocations] == [
        ("parameter", 0), ("thread-local", 0), ("constant", 0), ("preallocated-temp", 1), ("preallocated-temp", 0)]
    b = temp.breakdown(TPU_LIKE, temp_bytes=40960 + 2 * 16384)
    assert b == {"temp": 73728, "data": 8192, "tables": 32768, "outside": 32768, "tuple_values": 2,
                 "thread_local": 1, "constants": 1}


def test_a_cpu_program_s_intermediates_are_data(tmp_path):
    """A real compile: the [512, 1024] float32 intermediate kept alive across a matmul lies in the block."""

    def f(x, w):
        y = jnp.sin(x)  # 2 MiB, read again after the matmul
        return (y @ w).sum() + jnp.cos(y).sum()

    compiled = jax.jit(f).lower(jnp.ones((512, 1024)), jnp.ones((1024, 8))).compile(
        compiler_options={"xla_dump_to": str(tmp_path)})
    files = temp.dumps(str(tmp_path))
    assert len(files) == 1 and "jit_f" in files[0]
    with open(files[0]) as fh:
        text = fh.read()
    b = temp.breakdown(text, compiled.memory_analysis().temp_size_in_bytes)
    assert 512 * 1024 * 4 <= b["data"] <= b["temp"]
    assert b["data"] + b["tables"] + b["outside"] == b["temp"]


def test_a_dump_without_a_main_memory_block_is_refused():
    no_main = TPU_LIKE.replace("allocation 4: size 40960, preallocated-temp:", "allocation 4: size 40960, color 2, "
                               "preallocated-temp:")
    with pytest.raises(ValueError, match="found 0"):
        temp.breakdown(no_main, 0)


def test_the_command_reads_the_largest_program_of_a_folder(tmp_path, capsys):
    (tmp_path / "module_0001.jit_small.after_optimizations-buffer-assignment.txt").write_text(
        "allocation 0: size 8, preallocated-temp:\n value: <1 a @0> (size=8,offset=0): f32[2]{0}\n")
    (tmp_path / "module_0002.jit_loop.after_optimizations-buffer-assignment.txt").write_text(TPU_LIKE)
    assert temp.main([str(tmp_path), "73728"]) == 0
    out = capsys.readouterr().out
    assert "jit_loop" in out and "data         0.01 MB" in out and "1 thread-local scalars, 1 constants" in out
    assert temp.main([str(tmp_path / "missing")]) == 1


def test_the_layer_loop_probe_compiles_both_layouts_for_a_tpu():
    """`jspec.benchmarks.layer_loop_temp` at 4 layers and a 512-row cache (a few seconds): both layouts
    compile for the v5p, and the scan's compiler slots (tables + outside) are fewer than the unrolled
    loop's, which has a set per layer."""
    import os
    import subprocess

    from jspec.aot import devices

    from test_aot import REPO, _aot_python

    env = {**os.environ, **devices.aot_env("tpu-v5p"), "PYTHONPATH": REPO}
    proc = subprocess.run([_aot_python(), "-m", "jspec.benchmarks.layer_loop_temp", "--layers", "4",
                           "--cache-rows", "512"], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()
            if line.split()[:1] in (["unroll"], ["scan"])}
    assert set(rows) == {"unroll", "scan"}, proc.stdout
    slots = {layout: r[2] + r[3] for layout, r in rows.items()}
    assert slots["scan"] < slots["unroll"], proc.stdout
