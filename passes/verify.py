"""Proving a candidate site by running it: slice the pure subgraph from an anchor back to its frontier,
run the slice on concrete CPU tensors and compare it with a family's reference on probes.

A family binds some frontier nodes to its reference's named roles (q, k, a mask, ...) and supplies three
functions: the probes (role -> tensor, at sizes this module picks), the reference on a probe, and a comparison
that says what differs (`ulps_beyond` where a family allows a budget in ulps of the output's dtype). What probes
cannot establish stays the family's structural job; this only refuses candidates whose numbers disagree. Verdicts
are cached by a structural hash of the slice and the binding, so the same layer repeated N times is run once.

Sizes: a static size is the graph's own (the graph only ever runs at it); symbolic sizes get two assignments of
small values, pairwise distinct and distinct from the static sizes, so a transposed or merged dim shows up. The
values are ones the graph's shape environment admits (each symbol's value range, the guards and runtime asserts
among the slice's symbols), so a slice is probed at sizes the graph can run at, not at sizes its guards rule out
(a window count guarded to be 1, a length guarded to be 1 mod 4); where no such values are found within a small
search, the sizes are chosen as if the graph had no guards. The slice runs outside any fake mode on real tensors:
no guard of the graph's shape environment is touched.
"""

from __future__ import annotations

import hashlib
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import sympy
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .graph_utils import in_graph_order, val

MAX_NODES = 256
MAX_ELEMENTS = 1 << 22  # summed over the slice's tensors and its probed inputs at one size assignment
SYMBOL_SIZES = (5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43)
# Where the shape environment rules SYMBOL_SIZES out: the integers from a symbol's lower bound up this far are tried,
# with at most SEARCH_CHECKS evaluations of a guard in all (a probe's sizes stay small, the search cheap).
SEARCH_SPAN = 64
SEARCH_CHECKS = 20_000
# Python-level size arithmetic Dynamo leaves in a graph (`s0 // 2`, `min(k, T)`).
SIZE_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                            operator.truediv, operator.getitem, torch.sym_min, torch.sym_max, torch.sym_int,
                            torch.sym_float, min, max, math.ceil, math.floor})

Probe = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """`ok` True: every probe agreed; False: `reason` names the failing check; None: not run (too large)."""
    ok: bool | None
    reason: str = ""


@dataclass(frozen=True)
class Family:
    """What a family gives the verifier: probes at concrete role shapes, its reference, and a comparison
    returning None when the slice's outputs agree with the reference, else what differs."""
    probes: Callable[[dict[str, tuple], dict[str, torch.dtype]], list[tuple[str, Probe]]]
    reference: Callable[[Probe], Any]
    compare: Callable[[list, Any, Probe], str | None]


_CACHE: dict[str, Verdict] = {}


def is_pure(node: torch.fx.Node) -> bool:
    """A call the slice may re-run on probes: an aten op that neither mutates nor draws random numbers."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in SIZE_FUNCTIONS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in SEEDED_BY_DROPOUT:
        return _argument(node, "dropout_p", 0.0) == 0.0
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


# Fused attention ops tagged as seeded for their dropout: without dropout they compute the same every time.
SEEDED_BY_DROPOUT = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                               torch.ops.aten._scaled_dot_product_efficient_attention.default,
                               torch.ops.aten._scaled_dot_product_cudnn_attention.default})


def _argument(node: torch.fx.Node, name: str, default: Any) -> Any:
    """The argument `name` of a call of an op overload, by its schema."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def pure_slice(outputs: list[torch.fx.Node], stop: set, max_nodes: int = MAX_NODES) -> tuple[list, list] | None:
    """(slice nodes in graph order, frontier nodes): the pure ancestors of `outputs`, cut at `stop`, at
    anything impure and at graph inputs. None when it has more than `max_nodes` nodes."""
    inside, frontier, pending = set(), set(), list(outputs)
    while pending:
        node = pending.pop()
        if node in inside or node in frontier:
            continue
        if node in stop or not is_pure(node):
            frontier.add(node)
            continue
        inside.add(node)
        if len(inside) > max_nodes:
            return None
        pending.extend(node.all_input_nodes)
    return in_graph_order(inside), in_graph_order(frontier)


def latest_independent(output: torch.fx.Node, root: torch.fx.Node, keep) -> list[torch.fx.Node] | None:
    """The nodes of the pure slice from `output` back to `root` that are not computed from `root` and pass `keep`,
    less those another of them is computed from: the latest such values (the tables a formula of `root` reads, not
    what they are made from), in graph order; None when the slice does not reach `root`."""
    found = pure_slice([output], {root})
    if found is None or root not in found[1]:
        return None
    inside = set(found[0]) | set(found[1])
    derived, frontier = {root}, [root]
    while frontier:
        frontier = [u for n in frontier for u in n.users if u in inside and u not in derived]
        derived.update(frontier)
    candidates = [n for n in in_graph_order(inside - derived) if keep(n)]
    above = set()
    for node in candidates:
        pending = list(node.all_input_nodes)
        while pending:
            ancestor = pending.pop()
            if ancestor in inside and ancestor not in above:
                above.add(ancestor)
                pending.extend(ancestor.all_input_nodes)
    return [n for n in candidates if n not in above]


def rope_table_probes(shapes: dict, dtypes: dict, part: str, scale: float = 1.0) -> list[tuple[str, Probe]]:
    """Probes of a RoPE of the role `part` (values of every sign, times `scale`) at its `cos` / `sin` tables: tables
    of unrelated values (a spelling that reads one table for the other, or a table through anything but a product,
    fails), then tables of angles."""
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(shapes[part], generator=gen) * scale).to(dtypes[part])
    free = {name: torch.randn(shapes[name], generator=gen).to(dtypes[name]) for name in ("cos", "sin")}
    angles = torch.rand(shapes["cos"], generator=gen) * 6
    turns = {"cos": angles.cos().to(dtypes["cos"]), "sin": angles.sin().to(dtypes["sin"])}
    return [("free tables", {part: values, **free}), ("angles", {part: values, **turns})]


# The smallest normal fp32 value: an ulp floor for a family whose outputs may be all zeros where a spelling leaves
# subnormal dust.
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class UlpMiss:
    """Where an output is furthest past its budget (`ulps_beyond`): `where`, the index of the row (over the leading
    dims) where the magnitude is per row, else of the element; by how much (`error`, and in `ulps` of `dtype`); where
    a NaN or an infinity is not the reference's, the two values (`got`, `want`) instead."""
    where: tuple[int, ...]
    error: float
    ulps: float
    budget: float
    dtype: torch.dtype
    got: float | None = None
    want: float | None = None

    def __str__(self) -> str:
        if self.got is not None:
            return f"holds {self.got:g} where the reference holds {self.want:g}"
        return (f"differs by {self.error:.3g}, {self.ulps:.3g} ulps of {self.dtype} at its largest magnitude "
                f"(budget {self.budget})")


def ulps_beyond(out: torch.Tensor, ref: torch.Tensor, budget: float, magnitude: str | float = "row",
                floor: float = 0.0) -> UlpMiss | None:
    """None when `out` (as many values as `ref`, read in `ref`'s shape) holds NaN and the infinities exactly where
    `ref` does and its other values within `budget` ulps of `ref`'s dtype at a magnitude: the largest finite one of
    each row of `ref` (its last dim) for "row", of all of `ref` for "tensor", or the one given. Else where it is
    furthest off: the first row (or element) holding a NaN or an infinity the reference does not, else the one the
    most ulps off. An ulp is at least `floor`: at 0, a row (or tensor) whose magnitude is 0 must be exact."""
    if ref.numel() == 0:
        return None
    got, want = out.reshape(ref.shape).float(), ref.float()
    same = (got == want) | (got.isnan() & want.isnan())
    special = ~same & ~(got.isfinite() & want.isfinite())
    if special.any():
        first = int(special.reshape(-1).nonzero()[0, 0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), ref.shape))
        return UlpMiss(index[:-1] if magnitude == "row" else index, math.inf, math.inf, budget, ref.dtype,
                       got.reshape(-1)[first].item(), want.reshape(-1)[first].item())
    error = torch.where(same, 0.0, (got - want).abs()).double()
    sizes = want.nan_to_num(0.0, 0.0, 0.0).abs().double()
    if magnitude == "row":
        error, size = error.amax(-1), sizes.amax(-1)
    elif magnitude == "tensor":
        size = sizes.amax()
    else:
        size = torch.tensor(float(magnitude), dtype=torch.float64)
    ulps = torch.where(error == 0, 0.0, error / (torch.finfo(ref.dtype).eps * size).clamp_min(floor))
    worst = int(ulps.reshape(-1).argmax())
    if ulps.reshape(-1)[worst].item() <= budget:
        return None
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ulps.shape))
    return UlpMiss(where, error.reshape(-1)[worst].item(), ulps.reshape(-1)[worst].item(), budget, ref.dtype)


def _describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__ + (f":{value}" if isinstance(value, torch.SymInt) else "")


def structural_key(nodes: list, frontier: list, roles: dict[str, torch.fx.Node], extra: Any) -> str:
    """A hash of what the slice computes: each node's target and arguments, with nodes named by position and
    frontier nodes by role, dtype and shape; `extra` is whatever else the family's verdict depends on."""
    names = {}
    role_of = {node: role for role, node in roles.items()}
    parts = []
    for i, node in enumerate(frontier):
        names[node] = f"f{i}"
        constant = _constant(node)
        content = "" if constant is None else hashlib.sha256(
            constant.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        parts.append(f"f{i}={role_of.get(node, '?')}:{_describe_value(val(node))}{content}")
    for i, node in enumerate(nodes):
        names[node] = f"n{i}"
        args = torch.fx.map_arg((node.args, node.kwargs), names.__getitem__)
        parts.append(f"n{i}={node.target}{args!r}")
    parts.append(repr(extra))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _symbolic_sizes(values) -> Iterator[torch.SymInt]:
    for value in values:
        for size in value.shape if isinstance(value, torch.Tensor) else [value]:
            if isinstance(size, torch.SymInt):
                yield size


def _symbols(values) -> set:
    return {symbol for size in _symbolic_sizes(values) for symbol in size.node.expr.free_symbols}


def size_assignments(frontier: list, avoid: set, above: int = 0) -> list[dict]:
    """Values for the symbols in the frontier's sizes: none for a static slice, else two assignments (one where the
    shape environment admits no second), taking sizes over `above` first (a family's k, so a selection has keys to
    leave out). Values the graph's shape environment admits where a small search finds them, else SYMBOL_SIZES as
    if the graph had no guards."""
    values = [val(node) for node in frontier]
    symbols = sorted(_symbols(values), key=str)
    if not symbols:
        return [{}]
    shape_env = next((size.node.shape_env for size in _symbolic_sizes(values)), None)
    admitted = _SizeSearch.of(shape_env).assignments(tuple(symbols), frozenset(avoid), above) if shape_env else []
    if admitted:
        return admitted
    free = sorted((s for s in SYMBOL_SIZES if s not in avoid), key=lambda s: s <= above)
    if len(free) < 2 * len(symbols):
        return []
    return [dict(zip(symbols, free[i::2])) for i in (0, 1)]


class _SearchExhausted(Exception):
    """A search for admitted sizes spent its SEARCH_CHECKS."""


class _SizeSearch:
    """Sizes one shape environment admits: candidate values checked against each symbol's value range and the
    guards and runtime asserts (what every run of the graph satisfies) that read only the symbols being assigned;
    one that reads another symbol (another input's size) is not checked. A graph's slices share their symbols, so
    what is found is kept while the shape environment gains no fact."""

    _BY_SHAPE_ENV: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, shape_env) -> _SizeSearch:
        search = cls._BY_SHAPE_ENV.get(shape_env)
        if search is None or search.facts != _facts(shape_env):
            search = cls._BY_SHAPE_ENV[shape_env] = cls(shape_env)
        return search

    def __init__(self, shape_env):
        self.shape_env = shape_env
        self.facts = _facts(shape_env)
        self.sizes: dict = {}
        self.found: dict = {}
        self.checks = 0

    def holds(self, fact, assignment: dict) -> bool:
        """Whether `fact` holds at `assignment`; not where it cannot be evaluated there (a division by zero)."""
        self.checks += 1
        if self.checks > SEARCH_CHECKS:
            raise _SearchExhausted
        try:
            return fact.xreplace(assignment) not in (sympy.false, False)
        except (ArithmeticError, TypeError):
            return False

    def admitted_sizes(self, symbol) -> list[int]:
        """SYMBOL_SIZES, then the integers from the symbol's lower bound, that its range and its own facts admit."""
        if symbol not in self.sizes:
            bounds = self.shape_env.var_to_range.get(symbol)
            low = int(bounds.lower) if bounds is not None and isinstance(bounds.lower, sympy.Integer) else 0
            high = int(bounds.upper) if bounds is not None and isinstance(bounds.upper, sympy.Integer) else math.inf
            tried = list(SYMBOL_SIZES) + [s for s in range(max(low, 2), low + SEARCH_SPAN) if s not in SYMBOL_SIZES]
            own = [fact for fact in self.facts if fact.free_symbols == {symbol}]
            self.sizes[symbol] = [s for s in tried if low <= s <= high and all(self.holds(f, {symbol: s}) for f in own)]
        return self.sizes[symbol]

    def assignments(self, symbols: tuple, avoid: frozenset, above: int) -> list[dict]:
        """Two admitted assignments of `symbols`, their values pairwise distinct and outside `avoid`, sizes over `above`
        first; one where no second is found, none where no first is."""
        key = (symbols, avoid, above)
        if key not in self.found:
            self.checks, first = 0, None
            try:
                sizes = {symbol: sorted((s for s in self.admitted_sizes(symbol) if s not in avoid),
                                        key=lambda s: s <= above) for symbol in symbols}
                joint = [fact for fact in self.facts
                         if len(fact.free_symbols) > 1 and fact.free_symbols <= set(symbols)]
                for first in self._assignments(symbols, sizes, joint, frozenset(), {}):
                    for second in self._assignments(symbols, sizes, joint, frozenset(first.values()), {}):
                        self.found[key] = [first, second]
                        return self.found[key]
            except _SearchExhausted:
                pass
            self.found[key] = [first] if first is not None else []
        return self.found[key]

    def _assignments(self, symbols: tuple, sizes: dict, joint: list, taken: frozenset, partial: dict) -> Iterator[dict]:
        if len(partial) == len(symbols):
            yield dict(partial)
            return
        symbol = symbols[len(partial)]
        for size in sizes[symbol]:
            trial = {**partial, symbol: size}
            checked = [fact for fact in joint if symbol in fact.free_symbols and fact.free_symbols <= trial.keys()]
            if size not in taken and all(self.holds(fact, trial) for fact in checked):
                yield from self._assignments(symbols, sizes, joint, taken | {size}, trial)


def _facts(shape_env) -> list:
    """The shape environment's guards and runtime asserts, once each."""
    facts = [guard.expr for guard in shape_env.guards]
    facts += [check.expr for checks in shape_env.deferred_runtime_asserts.values() for check in checks]
    return list(dict.fromkeys(facts))


def concrete(size, assignment: dict) -> int:
    """A size (int or SymInt) at a symbol assignment."""
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.xreplace(assignment))
    return int(size)


def _static_sizes(values) -> set:
    return {s for v in values if isinstance(v, torch.Tensor) for s in v.shape if isinstance(s, int)}


def _elements(nodes: list, assignment: dict) -> int:
    total = 0
    for node in nodes:
        value = val(node)
        for tensor in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(tensor, torch.Tensor):
                total += math.prod(concrete(s, assignment) for s in tensor.shape)
    return total


def _on_cpu(arg):
    """A device argument (a constant's `device=`, a `device_put`) as the CPU, where the probes live."""
    return torch.device("cpu") if isinstance(arg, torch.device) else arg


def _sdpa_on_cpu(outputs: int, extra: tuple = ()) -> Callable:
    """A CUDA-only fused SDPA op (efficient, cuDNN) as the math SDPA on the CPU: its output first, the auxiliary
    outputs (log-sum-exp, RNG state) as None; a slice is only ever run where those are not read."""
    def run(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *unused, scale=None):
        out = torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_bias, dropout_p, is_causal,
                                                                 scale=scale)[0]
        return (out,) + (None,) * (outputs - 1)
    return run


def _histc_on_cpu(values, bins=100, min=0, max=0):
    """`histc` of integer values (CUDA has it, the CPU only for floats): counted in fp32, exact for the small
    integers probes hold, in the input's dtype as CUDA returns it."""
    return torch.histc(values.float(), bins, min, max).to(values.dtype)


# Ops without a CPU kernel (or without one for some dtypes), run as their CPU math when a slice holding them is
# probed.
CPU_STAND_INS: dict[Any, Callable] = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default: _sdpa_on_cpu(4),
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: _sdpa_on_cpu(9),
    torch.ops.aten.histc.default: _histc_on_cpu,
}


def run_slice(nodes: list, outputs: list, env: dict) -> list:
    """Run the slice's nodes on concrete values (`env`: frontier node -> value), on the CPU, outside fake mode."""
    env = dict(env)
    with unset_fake_temporarily(), torch.no_grad():
        for node in nodes:
            args, kwargs = torch.utils._pytree.tree_map(
                _on_cpu, torch.fx.map_arg((node.args, node.kwargs), env.__getitem__))
            env[node] = CPU_STAND_INS.get(node.target, node.target)(*args, **kwargs)
    return [env[node] for node in outputs]


def verify(outputs: list[torch.fx.Node], roles: dict[str, torch.fx.Node], family: Family, extra: Any = (),
           above: int = 0, max_nodes: int = MAX_NODES, max_elements: int = MAX_ELEMENTS,
           takes: Callable[[dict[str, torch.Tensor]], Any] | None = None) -> Verdict:
    """Whether the slice ending at `outputs`, with its frontier bound to `roles`, computes the family's reference
    on every probe at every size assignment (cached by the slice's structural hash and the sizes it is probed at,
    which the graph's guards choose). `takes`: the op's fake implementation on the roles as meta tensors (raising
    TypeError, ValueError or RuntimeError where their shapes do not fit it). The walk proves the roles' sizes
    consistent under the graph's guards; sizes chosen as if there were none (where no admitted ones were found) may
    not be, and such a slice is not run (None)."""
    found = pure_slice(outputs, set(roles.values()), max_nodes)
    if found is None:
        return Verdict(False, f"the slice from the anchor has more than {max_nodes} nodes")
    nodes, frontier = found
    assignments = size_assignments(frontier, _static_sizes(val(n) for n in frontier), above)
    if takes is not None and not _sizes_fit(roles, assignments, takes):
        return Verdict(None, "the graph's guards rule out the sizes the probes take")
    key = structural_key(nodes, frontier, roles, (extra, assignments))
    if key in _CACHE:
        return _CACHE[key]
    verdict = _run(nodes, frontier, outputs, roles, family, assignments, max_elements)
    if verdict.ok is not None:
        _CACHE[key] = verdict
    return verdict


def _sizes_fit(roles: dict[str, torch.fx.Node], assignments: list[dict],
               takes: Callable[[dict[str, torch.Tensor]], Any]) -> bool:
    for assignment in assignments:
        with unset_fake_temporarily():
            meta = {role: torch.empty([concrete(s, assignment) for s in val(node).shape], dtype=val(node).dtype,
                                      device="meta") for role, node in roles.items()}
            try:
                takes(meta)
            except (TypeError, ValueError, RuntimeError):
                return False
    return True


def _constant(node: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor a `get_attr` node reads (a constant the source built in forward), else None."""
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part, None)
    real = isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
    return value.detach().cpu() if real else None


def _run(nodes, frontier, outputs, roles, family: Family, assignments: list[dict], max_elements: int) -> Verdict:
    bound, constants = set(roles.values()), {}
    for node in frontier:
        if node in bound or isinstance(val(node), torch.SymInt):
            continue
        constants[node] = _constant(node)
        if constants[node] is None:
            return Verdict(False, f"the slice reads {node} ({_describe_value(val(node))}), bound to no role")
    if not assignments:
        return Verdict(None, "too many symbolic sizes to probe")
    probed = [node for node in frontier if node in bound]  # the probes build these: a checkpoint's expert stacks
    for assignment in assignments:
        if _elements(nodes + probed, assignment) > max_elements:
            return Verdict(None, f"probes over {max_elements} elements")
        shapes = {role: tuple(concrete(s, assignment) for s in val(node).shape) for role, node in roles.items()}
        dtypes = {role: val(node).dtype for role, node in roles.items()}
        sizes = {node: concrete(val(node), assignment) for node in frontier if isinstance(val(node), torch.SymInt)}
        for name, probe in family.probes(shapes, dtypes):
            env = {**constants, **sizes, **{roles[role]: tensor for role, tensor in probe.items()}}
            try:
                got = run_slice(nodes, outputs, env)
            except (RuntimeError, TypeError, ValueError, IndexError) as error:
                return Verdict(False, f"the slice does not run on the {name} probe ({type(error).__name__})")
            problem = family.compare(got, family.reference(probe), probe)
            if problem is not None:
                return Verdict(False, f"{name} probe: {problem}")
    return Verdict(True)


def clear_cache() -> None:
    _CACHE.clear()
