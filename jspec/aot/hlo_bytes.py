"""HBM bytes and kernel launches per iteration of a compiled while loop, read from optimized HLO text.

`compiled.as_text()` after XLA's optimizations is what the chip runs: every top-level instruction of a
computation is one kernel (a fusion, a custom call such as a Pallas kernel or a cuBLAS GEMM, a copy,
...) that reads its operands from memory and writes its results back. Bytes of one loop iteration =
the sum, over the instructions of the loop body, of operand bytes read + result bytes written, with:

- fusions counted at their boundary (what happens inside stays on chip), except that a fused
  parameter is read only where the kernel's outputs depend on it: the slices of it that slicing
  ops (slice / dynamic-slice / gather) take, followed back from the outputs through elementwise ops,
  layout changes, reductions and broadcasts (a fusion that reduces split-K partials and keeps a
  slice of the sum reads that slice's columns of every partial), through nested fusions too (a value
  that reaches a nested fusion's root is read as much as that fusion's result is read; at the root
  of the kernel's own fused computation it is read whole); and the buffer that a root
  dynamic-update-slice / scatter updates in place is neither read nor rewritten: only the update is
  written (XLA's own cost model counts slices and in-place updates alike);
- parameter, get-tuple-element, tuple, bitcast, constant and the *-done halves of async pairs free;
- inner while loops counted times their trip count: XLA's `known_trip_count` annotation, else the
  `i < N` pattern of the condition with a constant start and N constant, else, when N is carried
  through the loop from a value with a static upper bound (a `clip` / `minimum` with a constant, as a
  loop over the valid part of a cache has), at that bound (listed in `bounded_trips`: the cost at a
  full cache), else once (listed in `unknown_trips`);
- conditionals counted at their most expensive branch (listed in `notes`);
- a Pallas TPU kernel that declares what it moves (the `bytes_accessed` of its `pl.CostEstimate`, in
  the custom call's backend config) counts that, not its whole operands: its weight and cache
  operands are scaled down to what the declaration leaves after its other operands and its output
  (the tree kernel and the Q4 matmul read one layer of a stacked [L, ...] cache or weight through a
  prefetched layer index, so XLA sees all L layers as their operand);
- buffers outside device memory (a layout with a memory space S(n), n > 0: TPU VMEM / SMEM, host)
  are on-chip or off-device traffic and count zero.

Bytes are classified by the buffer they touch. Elements of a loop's state tuple get a class: weights
(loop-invariant elements that come from the program's weight arguments, named by `weight_args`, the
jitted function's argument names as in the entry parameters' op_name metadata; without names, every
loop-invariant element of at least `weight_min_bytes`), cache (carried elements of rank >= 4 and at
least `weight_min_bytes`: K/V caches) or other; inner loops inherit the class of each element's init
value (an element of an inner loop is never a weight or cache of its own).
Values derived by bitcast / get-tuple-element / tuple / in-place update keep their buffer's class.
Reads of weight buffers are `weights`, reads of cache buffers `kv_reads`, writes into cache buffers
(in-place updates, or values that become a cache element of the loop state) `cache_writes`, and all
the rest (activations, copies of weight or cache slices, logits, masks) `other`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

WEIGHT, CACHE, OTHER = "weight", "cache", "other"

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1,
}
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "add-dependency",
         "opt-barrier", "partition-id", "replica-id"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
# Ops whose result element at an index depends only on the operand elements at the same index (operands
# of the result's shape) or, for layout changes, on exactly one operand element.
_ELEMENTWISE = {
    "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "compare", "convert", "cosine",
    "divide", "erf", "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one",
    "logistic", "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt", "power", "real",
    "reduce-precision", "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt", "select",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan",
    "tanh", "xor",
}
_RELAYOUT = {"bitcast", "copy", "reshape", "transpose"}
_NO_KERNEL_CUSTOM_CALLS = {"AllocateBuffer", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a shape: element type, dimensions, memory space (0 = device memory)."""

    dtype: str
    dims: tuple[int, ...]
    space: int = 0

    @property
    def nbytes(self) -> int:
        return int(math.ceil(math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4)))

    @property
    def hbm_bytes(self) -> int:
        return self.nbytes if self.space == 0 else 0


@dataclasses.dataclass
class Instr:
    name: str
    shape: object  # Leaf, or a list of shapes for a tuple
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attrs)
        return m.group(1).replace("\\'", "'") if m else ""

    def attr(self, key: str) -> str | None:
        m = re.search(rf"(?:^|[ ,]){re.escape(key)}=(\"[^\"]*\"|%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%").strip('"') if m else None

    @property
    def backend_config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})", self.attrs)
        if not m:
            return {}
        text, depth = m.group(1), 0
        for i, ch in enumerate(text):  # the JSON object ends at its matching brace
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                try:
                    return json.loads(text[: i + 1])
                except ValueError:
                    return {}
        return {}


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    order: list[str]
    root: str
    params: dict[int, str]  # parameter number -> instruction name

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.order}
        for n in self.order:
            for o in self.instrs[n].operands:
                if o in out:
                    out[o].append(n)
        return out


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str


# ----------------------------------------------------------------------------------------------- parsing

def _matching(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index of the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_ch}{close_ch} in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_LEAF = re.compile(r"^([a-z]\w*)\[([^\]]*)\](\{[^}]*\})?$")


def parse_shape(text: str):
    """'bf16[2,3]{1,0:T(8,128)S(1)}' -> Leaf; '(s32[], f32[4])' -> [Leaf, Leaf]."""
    text = text.strip()
    if text.startswith("("):
        return [parse_shape(p) for p in _split_top(text[1:_matching(text, 0)])]
    m = _LEAF.match(text)
    if not m:
        if text in ("token[]", "token"):
            return Leaf("token", ())
        raise ValueError(f"cannot parse HLO shape {text!r}")
    dims = tuple(int(re.sub(r"[^0-9]", "", d) or 0) for d in m.group(2).split(",") if d.strip())
    space = re.search(r"S\((\d+)\)", m.group(3) or "")
    return Leaf(m.group(1), dims, int(space.group(1)) if space else 0)


def _leaves(shape) -> list[Leaf]:
    return [shape] if isinstance(shape, Leaf) else [x for s in shape for x in _leaves(s)]


def hbm_bytes(shape) -> int:
    return sum(l.hbm_bytes for l in _leaves(shape))


def _parse_instr(line: str) -> Instr | None:
    m = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape_text, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        shape_text, _, rest = rest.partition(" ")
    m2 = re.match(r"([\w\-]+)\(", rest)
    if not m2:
        return None
    opcode = m2.group(1)
    close = _matching(rest, m2.end() - 1)
    ops_text = rest[m2.end(): close]
    operands = [mm.group(1) for p in _split_top(ops_text) for mm in [re.search(r"%([\w.\-]+)\s*$", p.strip())] if mm]
    attrs = rest[close + 1:]
    if opcode in ("parameter", "constant"):  # keep the literal: parameter numbers, loop bounds
        attrs = f"{opcode}_value={ops_text.strip().replace(' ', '')}" + attrs
    return Instr(name, parse_shape(shape_text), opcode, operands, attrs, root)


def parse_module(text: str) -> Module:
    """Parse `compiled.as_text()` (optimized HLO) into computations of instructions."""
    text = re.sub(r"/\*.*?\*/", "", text)
    comps: dict[str, Computation] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
            if m:
                cur = Computation(m.group(2), {}, [], "", {})
                if m.group(1):
                    entry = m.group(2)
            continue
        if line.startswith("}"):
            if not cur.root and cur.order:
                cur.root = cur.order[-1]
            comps[cur.name] = cur
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is None:
            continue
        cur.instrs[ins.name] = ins
        cur.order.append(ins.name)
        if ins.root:
            cur.root = ins.name
        if ins.opcode == "parameter":
            cur.params[int(ins.attr("parameter_value"))] = ins.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text() of a compiled program")
    return Module(comps, entry)


# ----------------------------------------------------------------------------------------------- walking

@dataclasses.dataclass
class LoopBytes:
    """Bytes moved (device memory) and kernels launched by one iteration of a loop body."""

    weights: float = 0.0
    kv_reads: float = 0.0
    cache_writes: float = 0.0
    other: float = 0.0
    kernels: float = 0.0
    unknown_trips: list[str] = dataclasses.field(default_factory=list)
    # inner loops with a data-dependent trip count, counted at its static upper bound: name -> bound
    bounded_trips: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    # (computation/instruction, opcode, bytes per execution, executions per iteration), when traced
    items: list[tuple[str, str, float, float]] = dataclasses.field(default_factory=list)
    # computation/instruction -> its op_name metadata (the jax operation it came from), when traced
    op_names: dict[str, str] = dataclasses.field(default_factory=dict)
    # computation/instruction -> its (weights, kv_reads, cache_writes, other) bytes per execution, traced
    class_bytes: dict[str, tuple] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.kv_reads + self.cache_writes + self.other

    def add(self, other: "LoopBytes", times: float = 1.0) -> None:
        for f in ("weights", "kv_reads", "cache_writes", "other", "kernels"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        self.items += [(n, op, b, k * times) for n, op, b, k in other.items]
        self.op_names.update(other.op_names)
        self.class_bytes.update(other.class_bytes)
        self.unknown_trips += [t for t in other.unknown_trips if t not in self.unknown_trips]
        self.bounded_trips.update(other.bounded_trips)
        self.notes += [n for n in other.notes if n not in self.notes]

    def as_dict(self) -> dict:
        return {"weights": self.weights, "kv_reads": self.kv_reads, "cache_writes": self.cache_writes,
                "other": self.other, "total": self.total, "kernels": self.kernels,
                "unknown_trips": list(self.unknown_trips), "bounded_trips": dict(self.bounded_trips),
                "notes": list(self.notes)}


def _through_bitcasts(comp: Computation, name: str) -> Instr:
    ins = comp.instrs[name]
    while ins.opcode == "bitcast" and ins.operands:
        ins = comp.instrs[ins.operands[0]]
    return ins


def _const_int(comp: Computation, name: str) -> int | None:
    ins = _through_bitcasts(comp, name)
    while ins.opcode == "copy" and ins.operands:
        ins = _through_bitcasts(comp, ins.operands[0])
    if ins.opcode != "constant":
        return None
    value = ins.attr("constant_value")
    return int(value) if value is not None and re.fullmatch(r"-?\d+", value) else None


class Walker:
    """Walk a parsed module; `loop_bytes(while_instr)` gives one iteration of that loop's body."""

    def __init__(self, module: Module, weight_min_bytes: int = 1 << 20, trace: bool = False,
                 weight_args: tuple[str, ...] | None = None):
        self.m = module
        self.trace = trace
        self.weight_min = weight_min_bytes
        self.weight_args = tuple(weight_args) if weight_args else None
        self._users: dict[str, dict[str, list[str]]] = {}
        self._fractions: dict[tuple, float] = {}  # _read_fraction memo (fused values are DAGs)
        self._bounded: dict[str, int] = {}  # loops counted at a static upper bound of their trip count

    # -- helpers over fused computations
    def _users_of(self, comp: Computation) -> dict[str, list[str]]:
        if comp.name not in self._users:
            self._users[comp.name] = comp.users()
        return self._users[comp.name]

    def _in_place_params(self, comp: Computation) -> dict[int, float]:
        """Fused parameters updated in place by a root DUS / scatter -> bytes of the update written."""
        root = comp.instrs[comp.root]
        outs = [comp.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]
        found: dict[int, float] = {}
        for out in outs:
            out = _through_bitcasts(comp, out.name)
            if out.opcode not in _IN_PLACE:
                continue
            buf = _through_bitcasts(comp, out.operands[0])
            if buf.opcode == "parameter":
                upd = out.operands[2] if out.opcode == "scatter" else out.operands[1]
                found[int(buf.attr("parameter_value"))] = _leaves(comp.instrs[upd].shape)[0].nbytes
        return found

    def _effective_read(self, comp: Computation, name: str, outer: tuple = ()) -> float:
        """Bytes a fused value is actually read: the value's bytes times `_read_fraction`."""
        return sum(l.nbytes for l in _leaves(comp.instrs[name].shape)) * self._read_fraction(comp, name, outer)

    def _read_fraction(self, comp: Computation, name: str, outer: tuple = ()) -> float:
        """Fraction (an upper bound) of a fused value's elements that the kernel reads: the elements its
        outputs depend on. A fusion's emitter computes each output element from the operand elements it
        needs, so a value is read only where its users read it, followed back from the outputs through
        slices (the sliced elements), elementwise ops and layout changes (the same elements), reductions
        (the reduced extent of the needed outputs), broadcasts (at most one element per needed output)
        and in-place updates (the updated buffer is not read); any other user reads it whole. The users'
        fractions add up (overlaps counted twice), capped at 1.

        `outer` holds the (computation, fusion instruction) frames of the fusions that `comp` is
        nested in, innermost last: a value that reaches the root of a nested fusion (a parameter
        only bitcast there, say) is read as much as that fusion's result is read where it is used.
        At the root of the outermost fused computation the value is the kernel's output: read whole.
        """
        key = (comp.name, name, tuple((c.name, u) for c, u in outer))
        if key not in self._fractions:
            self._fractions[key] = self._read_fraction_uncached(comp, name, outer)
        return self._fractions[key]

    def _read_fraction_uncached(self, comp: Computation, name: str, outer: tuple) -> float:
        users = self._users_of(comp)[name]
        if name == comp.root:
            if not outer or users:
                return 1.0
            return self._read_fraction(*outer[-1], outer[:-1])
        if not users:
            return 0.0
        shape = comp.instrs[name].shape
        if not isinstance(shape, Leaf):
            return 1.0
        count = math.prod(shape.dims)
        total = 0.0
        for u in users:
            ui = comp.instrs[u]
            first = bool(ui.operands) and ui.operands[0] == name
            if ui.opcode == "fusion":
                inner = self.m.computations[ui.attr("calls")]
                total += sum(self._read_fraction(inner, inner.params[k], outer + ((comp, u),))
                             for k, o in enumerate(ui.operands) if o == name)
            elif ui.opcode in _IN_PLACE and first:
                continue  # updated in place: not read
            elif not isinstance(ui.shape, Leaf):
                return 1.0
            elif ui.opcode in _RELAYOUT or (ui.opcode in _ELEMENTWISE and math.prod(ui.shape.dims) == count) or \
                    (ui.opcode == "reduce" and name in ui.operands[: len(ui.operands) // 2]):
                total += self._read_fraction(comp, u, outer)
            elif (ui.opcode in _SLICING and first) or ui.opcode == "broadcast":
                total += self._read_fraction(comp, u, outer) * math.prod(ui.shape.dims) / max(count, 1)
            else:
                return 1.0
            if total >= 1.0:
                return 1.0
        return total

    # -- loop state classes
    def _trip_count(self, comp: Computation, ins: Instr) -> int | None:
        """Trips of while `ins`: XLA's known_trip_count, else `i < N` with a constant start and a bound
        N that is a constant, or carried unchanged from a value with a static upper bound (then the
        loop is counted at that bound and `self._bounded` records it)."""
        n = ins.backend_config.get("known_trip_count", {}).get("n")
        if n is not None:
            return int(n)
        cond = self.m.computations.get(ins.attr("condition"))
        body = self.m.computations.get(ins.attr("body"))
        if cond is None or body is None:
            return None
        root = _through_bitcasts(cond, cond.root)
        if root.opcode == "fusion":  # GPU wraps the compare in a fusion
            fused = self.m.computations[root.attr("calls")]
            cmp = _through_bitcasts(fused, fused.root)
            if cmp.opcode != "compare":
                return None
            sides = []
            for o in cmp.operands:
                x = _through_bitcasts(fused, o)
                if x.opcode == "parameter":
                    sides.append((cond, root.operands[int(x.attr("parameter_value"))]))
                else:
                    sides.append((fused, x.name))
        elif root.opcode == "compare":
            cmp = root
            sides = [(cond, o) for o in root.operands]
        else:
            return None
        if "direction=LT" not in cmp.attrs:
            return None
        counter = _through_bitcasts(*sides[0])
        if counter.opcode != "get-tuple-element":
            return None
        init = _through_bitcasts(comp, ins.operands[0])
        if init.opcode != "tuple":
            return None
        bound = _const_int(*sides[1])
        exact = True
        if bound is None:
            rhs = _through_bitcasts(*sides[1])
            if sides[1][0] is cond and rhs.opcode == "get-tuple-element" and \
                    self._passes_through(ins, int(rhs.attr("index"))):
                src = init.operands[int(rhs.attr("index"))]  # a bound carried unchanged through the loop
                bound = _const_int(comp, src)
                if bound is None:
                    bound, exact = self._upper_bound(comp, src), False
        if bound is None:
            return None
        k = int(counter.attr("index"))
        start = _const_int(comp, init.operands[k])
        step_ins = _through_bitcasts(body, body.instrs[body.root].operands[k])
        if start is None or step_ins.opcode not in ("add", "fusion"):
            return None
        if not exact:
            self._bounded[f"{comp.name}/{ins.name}"] = max(bound - start, 0)
        return max(bound - start, 0)

    def _upper_bound(self, comp: Computation, name: str, env: dict | None = None, depth: int = 0) -> int | None:
        """A static upper bound of an integer scalar: constants through copies, converts, tuples,
        fusions, clamp (its upper end), minimum (its smallest bounded operand), maximum and select (the
        largest, when all are bounded). `env` maps a fused computation's parameters to the fusion's
        operands."""
        if depth > 64:
            return None
        ins = _through_bitcasts(comp, name)
        op = ins.opcode
        rec = lambda c, n, e=env: self._upper_bound(c, n, e, depth + 1)
        if op == "constant":
            return _const_int(comp, ins.name)
        if op == "parameter" and env is not None:
            outer_comp, outer_ins, outer_env = env["comp"], env["ins"], env["env"]
            k = int(ins.attr("parameter_value"))
            return self._upper_bound(outer_comp, outer_ins.operands[k], outer_env, depth + 1) \
                if k < len(outer_ins.operands) else None
        if op in ("copy", "convert", "reshape", "broadcast") and ins.operands:
            return rec(comp, ins.operands[0])
        if op == "clamp" and len(ins.operands) == 3:
            return rec(comp, ins.operands[2])
        if op == "minimum":
            known = [b for b in (rec(comp, o) for o in ins.operands) if b is not None]
            return min(known) if known else None
        if op in ("maximum", "select"):
            ops = ins.operands[1:] if op == "select" else ins.operands
            known = [rec(comp, o) for o in ops]
            return max(known) if known and None not in known else None
        if op == "fusion":
            fused = self.m.computations[ins.attr("calls")]
            return self._upper_bound(fused, fused.root, {"comp": comp, "ins": ins, "env": env}, depth + 1)
        if op == "get-tuple-element":
            src = _through_bitcasts(comp, ins.operands[0])
            k = int(ins.attr("index"))
            if src.opcode == "tuple":
                return rec(comp, src.operands[k])
            if src.opcode == "fusion":
                fused = self.m.computations[src.attr("calls")]
                froot = _through_bitcasts(fused, fused.root)
                if froot.opcode == "tuple":
                    return self._upper_bound(fused, froot.operands[k], {"comp": comp, "ins": src, "env": env},
                                             depth + 1)
            if src.opcode == "while" and self._passes_through(src, k):
                init = _through_bitcasts(comp, src.operands[0])
                if init.opcode == "tuple":
                    return rec(comp, init.operands[k])
        return None

    def _source(self, comp: Computation, name: str) -> Instr:
        """The instruction a value comes from, looking through bitcasts, tuples and loops that pass
        the value through unchanged."""
        ins = _through_bitcasts(comp, name)
        for _ in range(64):
            if ins.opcode != "get-tuple-element":
                return ins
            src = _through_bitcasts(comp, ins.operands[0])
            k = int(ins.attr("index"))
            if src.opcode == "tuple":
                ins = _through_bitcasts(comp, src.operands[k])
            elif src.opcode == "while" and self._passes_through(src, k):
                init = _through_bitcasts(comp, src.operands[0])
                if init.opcode != "tuple":
                    return ins
                ins = _through_bitcasts(comp, init.operands[k])
            else:
                return ins
        return ins

    def _passes_through(self, loop: Instr, k: int) -> bool:
        body = self.m.computations[loop.attr("body")]
        root = body.instrs[body.root]
        if root.opcode != "tuple":
            return False
        src = self._source(body, root.operands[k])
        return src.opcode == "get-tuple-element" and src.operands == [body.params[0]] and int(src.attr("index")) == k

    def _is_weight_arg(self, ins: Instr) -> bool:
        """An entry parameter whose op_name (jax's argument path, e.g. params['layers'][0]['wq']) starts
        with one of `weight_args`."""
        name = ins.op_name
        return any(name == a or name.startswith(a + "[") or name.startswith(a + ".") for a in self.weight_args)

    def weight_elements(self, comp: Computation, loop: Instr) -> set[int] | None:
        """Indices of the state elements of `loop` (a while of the entry computation) that are weight
        arguments of the program or computed from them alone before the loop; None without
        `weight_args`."""
        if self.weight_args is None:
            return None
        init = _through_bitcasts(comp, loop.operands[0])
        if init.opcode != "tuple":
            return set()
        if comp.name != self.m.entry:
            return set()
        return {k for k, o in enumerate(init.operands) if self._from_weights(comp, o) == WEIGHT}

    def _from_weights(self, comp: Computation, name: str, depth: int = 0) -> str | None:
        """WEIGHT when the entry value `name` is a weight argument or computed only from weight
        arguments and constants (a relayout, a concatenation of wk and wv that XLA hoisted out of the
        loop), "constant" when only from constants, else None."""
        ins = self._source(comp, name)
        if ins.opcode == "parameter":
            return WEIGHT if self._is_weight_arg(ins) else None
        if ins.opcode in ("constant", "iota"):
            return "constant"
        if depth > 8 or not ins.operands or ins.opcode in ("while", "conditional", "call", "custom-call", "rng",
                                                             "rng-bit-generator"):
            return None
        kinds = {self._from_weights(comp, o, depth + 1) for o in ins.operands}
        if None in kinds:
            return None
        return WEIGHT if WEIGHT in kinds else "constant"

    def _state_classes(self, body: Computation, init: list | None, weights: set[int] | None = None) -> list[str]:
        param = body.instrs[body.params[0]]
        elems = param.shape if isinstance(param.shape, list) else [param.shape]
        root = body.instrs[body.root]
        out = []
        for i, shape in enumerate(elems):
            given = init[i] if init is not None and i < len(init) else None
            if isinstance(given, str) and given in (WEIGHT, CACHE):
                out.append(given)
                continue
            if init is not None:  # an inner loop: its state is a weight or a cache only if its init is
                out.append(OTHER)  # (an attention loop's running sums are not a cache, however large)
                continue
            if isinstance(shape, list):
                out.append(OTHER)
                continue
            src = self._source(body, root.operands[i]) if root.opcode == "tuple" else None
            invariant = (src is not None and src.opcode == "get-tuple-element" and src.operands == [param.name]
                         and int(src.attr("index")) == i)
            big = shape.nbytes >= self.weight_min
            if weights is not None and init is None:
                if invariant and i in weights:
                    out.append(WEIGHT)
                    continue
                if invariant:  # loop-invariant but not a weight argument (masks, tables, prompt state)
                    out.append(OTHER)
                    continue
            if invariant and big and init is None:
                out.append(WEIGHT)
            elif not invariant and big and len(shape.dims) >= 4:
                out.append(CACHE)
            else:
                out.append(OTHER)
        return out

    # -- the walk
    def loop_bytes(self, comp: Computation, ins: Instr, init: list | None = None) -> tuple[LoopBytes, list[str]]:
        """One iteration of while `ins` (in `comp`): bytes, and the classes of its state elements."""
        body = self.m.computations[ins.attr("body")]
        classes = self._state_classes(body, init, self.weight_elements(comp, ins) if init is None else None)
        return self.walk(body, {0: classes}, sink=self._cache_sinks(body, classes)), classes

    def _cache_sinks(self, body: Computation, classes: list[str]) -> set[str]:
        root = body.instrs[body.root]
        if root.opcode != "tuple":
            return set()
        return {_through_bitcasts(body, o).name for i, o in enumerate(root.operands)
                if i < len(classes) and classes[i] == CACHE}

    def walk(self, comp: Computation, param_classes: dict, sink: set[str] = frozenset()) -> LoopBytes:
        acc = LoopBytes()
        cls: dict[str, object] = {}

        def of(name):
            return cls.get(name, OTHER)

        for name in comp.order:
            ins = comp.instrs[name]
            op = ins.opcode
            if op == "parameter":
                cls[name] = param_classes.get(int(ins.attr("parameter_value")), OTHER)
                continue
            if op == "get-tuple-element":
                src = of(ins.operands[0])
                cls[name] = src[int(ins.attr("index"))] if isinstance(src, list) else src
                continue
            if op == "tuple":
                cls[name] = [of(o) for o in ins.operands]
                continue
            if op == "bitcast":
                cls[name] = of(ins.operands[0])
                continue
            if op in _FREE or op.endswith("-done"):
                continue
            if op == "while":
                trips = self._trip_count(comp, ins)
                inner, classes = self.loop_bytes(comp, ins, init=of(ins.operands[0]) if isinstance(
                    of(ins.operands[0]), list) else None)
                if trips is None:
                    acc.unknown_trips.append(f"{comp.name}/{name}")
                elif f"{comp.name}/{name}" in self._bounded:
                    acc.bounded_trips[f"{comp.name}/{name}"] = trips
                acc.add(inner, 1 if trips is None else trips)
                cls[name] = classes
                continue
            if op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", ins.attrs).group(1)) \
                    if "branch_computations" in ins.attrs else [ins.attr("true_computation"), ins.attr("false_computation")]
                best = None
                for k, b in enumerate(branches):
                    res = self.walk(self.m.computations[b], {0: of(ins.operands[k + 1])})
                    best = res if best is None or res.total > best.total else best
                acc.add(best)
                acc.notes.append(f"{name}: conditional counted at its largest of {len(branches)} branches")
                continue
            if op == "call":
                callee = self.m.computations[ins.attr("to_apply")]
                acc.add(self.walk(callee, {k: of(o) for k, o in enumerate(ins.operands)}))
                continue
            if op == "custom-call" and ins.attr("custom_call_target") in _NO_KERNEL_CUSTOM_CALLS:
                continue
            self._kernel(comp, ins, of, acc, cls, sink)
        return acc

    def items_hook(self, acc: LoopBytes, comp: Computation, ins: Instr, nbytes: float) -> None:
        if self.trace:
            key = f"{comp.name}/{ins.name}"
            acc.items.append((key, ins.opcode, nbytes, 1.0))
            op_name = ins.op_name
            if not op_name and ins.opcode == "fusion":  # else the fused root's, a dot's or any inside
                fused = self.m.computations.get(ins.attr("calls"))
                if fused:
                    op_name = self._fusion_op_name(fused)
            if op_name:
                acc.op_names[key] = op_name

    def _fusion_op_name(self, fused: Computation) -> str:
        """The op_name of a fused computation: its root's, else that of the first named user of its
        largest parameter (what reads the big buffer), else a dot's, else any."""
        root = fused.instrs[fused.root]
        if root.op_name:
            return root.op_name
        users = self._users_of(fused)
        params = sorted(fused.params.values(), key=lambda n: -hbm_bytes(fused.instrs[n].shape))
        for p in params[:1]:
            todo, seen = list(users[p]), set()
            while todo:
                u = todo.pop(0)
                if u in seen:
                    continue
                seen.add(u)
                if fused.instrs[u].op_name:
                    return fused.instrs[u].op_name
                todo += users[u]
        inner = sorted((fused.instrs[n] for n in fused.order),
                       key=lambda i: i.opcode not in ("dot", "convolution", "custom-call"))
        return next((i.op_name for i in inner if i.op_name), "")

    def _kernel(self, comp, ins: Instr, of, acc: LoopBytes, cls: dict, sink) -> None:
        op = ins.opcode
        acc.kernels += 1
        reads = []  # (class, bytes)
        write = float(hbm_bytes(ins.shape))
        out_class = OTHER
        if op == "fusion":
            fused = self.m.computations[ins.attr("calls")]
            in_place = self._in_place_params(fused)
            for k, o in enumerate(ins.operands):
                oshape = comp.instrs[o].shape
                if hbm_bytes(oshape) == 0:
                    continue
                if k in in_place:
                    out_class = of(o) if isinstance(of(o), str) else OTHER
                    continue
                reads.append((of(o), self._effective_read(fused, fused.params[k])))
            if in_place:  # the update lands in the buffer's memory: count it where that is device memory
                rewritten = sum(hbm_bytes(comp.instrs[ins.operands[k]].shape) for k in in_place)
                write = max(write - rewritten, 0.0) + sum(
                    b for k, b in in_place.items() if hbm_bytes(comp.instrs[ins.operands[k]].shape))
        elif op in _IN_PLACE:
            out_class = of(ins.operands[0]) if isinstance(of(ins.operands[0]), str) else OTHER
            upd = ins.operands[2] if op == "scatter" else ins.operands[1]
            for o in ins.operands[1:]:
                reads.append((of(o), float(hbm_bytes(comp.instrs[o].shape))))
            # Written into the updated buffer (an update held in VMEM still lands in device memory).
            write = float(_leaves(comp.instrs[upd].shape)[0].nbytes) if hbm_bytes(ins.shape) else 0.0
        elif op in _SLICING:
            reads.append((of(ins.operands[0]), write if hbm_bytes(comp.instrs[ins.operands[0]].shape) else 0.0))
            for o in ins.operands[1:]:
                reads.append((of(o), float(hbm_bytes(comp.instrs[o].shape))))
        elif op.endswith("-start"):
            # Async pair: the start moves the operand; its result tuple also names the source buffer.
            src = ins.operands[0] if ins.operands else None
            if src is not None:
                reads.append((of(src), float(hbm_bytes(comp.instrs[src].shape))))
            dest = ins.shape[0] if isinstance(ins.shape, list) else ins.shape
            write = float(hbm_bytes(dest))
        else:
            for o in ins.operands:
                reads.append((of(o), float(hbm_bytes(comp.instrs[o].shape))))
            declared = _DECLARED_BYTES.search(ins.attrs) if op == "custom-call" else None
            if declared:
                reads = _within_declared(reads, float(declared.group(1)) - write)
        self.items_hook(acc, comp, ins, sum(b for _, b in reads) + write)
        split = [0.0, 0.0, 0.0, 0.0]  # weights, kv_reads, cache_writes, other
        for c, b in reads:
            c = c if isinstance(c, str) else OTHER
            split[0 if c == WEIGHT else 1 if c == CACHE else 3] += b
        if out_class == CACHE or ins.name in sink:
            split[2] += write
            cls[ins.name] = CACHE
        else:
            split[3] += write
            cls[ins.name] = out_class if out_class != CACHE else OTHER
        acc.weights += split[0]
        acc.kv_reads += split[1]
        acc.cache_writes += split[2]
        acc.other += split[3]
        if self.trace:
            acc.class_bytes[f"{comp.name}/{ins.name}"] = tuple(split)


_DECLARED_BYTES = re.compile(r'"cost_estimate":\s*\{[^}]*"bytes_accessed":\s*"?(\d+)')


def _within_declared(reads: list[tuple], budget: float) -> list[tuple]:
    """A kernel's operand reads with its weight and cache reads scaled down so that all reads fit
    `budget`, the bytes it declares it reads (never scaled up: a declaration cannot add reads)."""
    stacks = (WEIGHT, CACHE)
    fixed = sum(b for c, b in reads if c not in stacks)
    big = sum(b for c, b in reads if c in stacks)
    if big <= 0 or fixed + big <= budget:
        return reads
    f = max(budget - fixed, 0.0) / big
    return [(c, b * f if c in stacks else b) for c, b in reads]


def find_decode_loop(module: Module) -> Instr:
    """The entry computation's while loop without a known trip count (the decode loop; a layer scan
    has one); among several, the one with the most instructions in its body and its inner loops'
    bodies (XLA:TPU may also leave a prefill layer loop open-ended)."""
    entry = module.computations[module.entry]
    loops = [entry.instrs[n] for n in entry.order if entry.instrs[n].opcode == "while"]
    if not loops:
        raise ValueError("the entry computation has no while loop: compile the whole generation, loop included")
    open_ended = [w for w in loops if "known_trip_count" not in w.attrs] or loops

    def size(comp_name: str, depth: int = 0) -> int:  # instructions of a body and of its inner loops' bodies
        comp = module.computations[comp_name]
        inner = [comp.instrs[n].attr("body") for n in comp.order if comp.instrs[n].opcode == "while"]
        return len(comp.order) + (sum(size(b, depth + 1) for b in inner) if depth < 8 else 0)

    return max(open_ended, key=lambda w: size(w.attr("body")))


def decode_loop_bytes(hlo_text: str, weight_min_bytes: int = 1 << 20, trace: bool = False,
                      weight_args: tuple[str, ...] | None = None) -> LoopBytes:
    """Bytes and kernels of one round of the decode loop in `compiled.as_text()`; with `trace`, the
    per-kernel contributions in `.items` (and their op_name metadata in `.op_names`). With
    `weight_args` (argument names of the jitted function, e.g. ("params",)), weights are the loop
    state elements that come from those arguments; without, the loop-invariant ones of at least
    `weight_min_bytes`."""
    module = parse_module(hlo_text)
    loop = find_decode_loop(module)
    walker = Walker(module, weight_min_bytes, trace, weight_args)
    res, _ = walker.loop_bytes(module.computations[module.entry], loop)
    return res


def memory_stats(compiled) -> dict:
    """`compiled.memory_analysis()` as a dict of byte counts (argument, output, alias, temp, code, peak:
    the compiler's simulated heap peak, 0 where the backend does not report it)."""
    ma = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes", "peak_memory_in_bytes")
    return {k.replace("_size_in_bytes", "").replace("_in_bytes", ""): int(getattr(ma, k, 0) or 0) for k in keys}
