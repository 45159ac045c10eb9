"""What a compiled program's temp memory holds, from XLA's buffer-assignment dump.

    python -m jspec.aot.temp DIR [TEMP_BYTES]    # DIR: a dump, e.g. from XLA_FLAGS=--xla_dump_to=DIR

(`jspec bench --aot` splits every program it compiles this way and prints the split of each row that
fails its temp target.)

`memory_analysis().temp_size_in_bytes` is one number; the bench's temp target needs to know whether it
is data (activations, logits, sampling buffers: what the program's code decides) or the compiler's
bookkeeping, which grows with the number of operations in the program rather than with its shapes. The
dump's `*after_optimizations-buffer-assignment.txt` tells them apart:

  data        the extent of the array values inside the main memory's preallocated temp block (color
              0): where the last array ends;
  tables      the rest of that block: tuple-shaped values (multi-output fusions, async copies, loop
              states), which XLA:TPU places above the arrays, one slot each;
  outside     temp_size_in_bytes minus the block: allocations of their own, i.e. the scalars of
              reduction computations ("thread-local") and the program's constants, counted here by
              number (`thread_local`, `constants`).

On XLA:TPU a Qwen3-8B loop with its 36 layers unrolled spends most of its temp on the last two (the
README's TPU v5p tables under "Without an accelerator"); both shrink with fewer operations, not with
smaller arrays (`python -m jspec.benchmarks.layer_loop_temp`).
"""

from __future__ import annotations

import glob
import os
import re
import sys

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")


def parse(text: str) -> list[dict]:
    """The allocations of a buffer-assignment dump: index, size, color (0 = the main memory), kind
    ("parameter", "output", "maybe-live-out", "preallocated-temp", "thread-local", "constant", or the
    dump's own word) and values [(name, size, offset, shape text)]."""
    allocations = []
    for line in text.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            tags = m.group(3)
            color = re.search(r"color (\d+)", tags)
            kind = re.sub(r"color \d+,\s*", "", tags).split(" ", 1)[0].rstrip(":,")
            allocations.append({"index": int(m.group(1)), "size": int(m.group(2)), "kind": kind,
                                "color": int(color.group(1)) if color else 0, "values": []})
            continue
        m = _VALUE.match(line)
        if m and allocations:
            allocations[-1]["values"].append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    return allocations


def breakdown(text: str, temp_bytes: int | None = None) -> dict:
    """Split `temp_bytes` (the program's `memory_analysis().temp_size_in_bytes`) by what it holds (the
    module docstring's data / tables / outside). Without temp_bytes, the temp block alone (`outside` 0).
    Raises ValueError when the dump has no main-memory temp block."""
    allocations = parse(text)
    blocks = [a for a in allocations if a["kind"] == "preallocated-temp" and a["color"] == 0]
    if len(blocks) != 1:
        raise ValueError(f"expected one preallocated temp block in main memory (color 0), found {len(blocks)}: "
                         f"pass the dump of the program's after_optimizations-buffer-assignment.txt")
    block = blocks[0]
    arrays = [(size, offset) for _, size, offset, shape in block["values"] if not shape.startswith("(")]
    data = max((size + offset for size, offset in arrays), default=0)
    main = [a for a in allocations if a["color"] == 0]
    temp_bytes = block["size"] if temp_bytes is None else temp_bytes
    return {
        "temp": temp_bytes,
        "data": data,
        "tables": block["size"] - data,
        "outside": temp_bytes - block["size"],
        "tuple_values": sum(shape.startswith("(") for _, _, _, shape in block["values"]),
        "thread_local": sum(a["kind"] == "thread-local" for a in main),
        "constants": sum(a["kind"] == "constant" for a in main),
    }


def dumps(directory: str) -> list[str]:
    """The buffer-assignment files of a dump directory, largest program first."""
    files = glob.glob(os.path.join(directory, "*after_optimizations-buffer-assignment.txt"))
    return sorted(files, key=os.path.getsize, reverse=True)


def compile_and_split(lowered):
    """`lowered.compile()` with XLA's dump written to a temporary folder: (compiled, `breakdown` of its
    temp). The folder (tens of MB for a Qwen3-8B loop) is removed before returning."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jspec-temp-") as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        with open(dumps(dump)[0]) as f:
            split = breakdown(f.read(), int(compiled.memory_analysis().temp_size_in_bytes))
    return compiled, split


def main(argv=None) -> int:
    """`python -m jspec.aot.temp DIR [TEMP_BYTES]`: the largest program's buffer assignment in DIR,
    split into data and the compiler's slots. Without TEMP_BYTES the `outside` share is not known and
    is left out."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    files = dumps(argv[0])
    if not files:
        print(f"no *after_optimizations-buffer-assignment.txt in {argv[0]}: compile with "
              f"XLA_FLAGS=--xla_dump_to={argv[0]}", file=sys.stderr)
        return 1
    with open(files[0]) as f:
        text = f.read()
    b = breakdown(text, int(argv[1]) if len(argv) == 2 else None)
    print(os.path.basename(files[0]))
    mb = lambda x: f"{x / 1e6:8.2f} MB"  # noqa: E731
    print(f"  data     {mb(b['data'])}")
    print(f"  tables   {mb(b['tables'])}  ({b['tuple_values']} tuple-shaped values in the block)")
    if len(argv) == 2:
        print(f"  outside  {mb(b['outside'])}  ({b['thread_local']} thread-local scalars, {b['constants']} constants)")
    print(f"  temp     {mb(b['temp'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
