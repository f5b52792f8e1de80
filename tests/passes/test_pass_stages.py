"""Every family keeps the stages a pass is built from (docs/passes.md, "How a pass is built"): anchors declared as
module constants and handed to `rewrite_anchored` with a binder (`_match*`) and a rewrite (`_rewrite*`, which records
its site), and a verifier (`_verify*`) that runs `verify` against a reference from `dsfuse.kernels`. Read from the
sources, following what each family's `run` reaches, so a family that drops a stage fails here without compiling."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dsfuse.passes import FAMILIES

PASSES_PACKAGE = "dsfuse.passes."
KERNELS_PACKAGE = "dsfuse.kernels."
REFERENCE_SUFFIXES = ("_reference", "_math")


@functools.cache
def _tree(module: ModuleType) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


@functools.cache
def _functions(module: ModuleType) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in _tree(module).body if isinstance(node, ast.FunctionDef)}


@functools.cache
def _assignments(module: ModuleType) -> dict[str, ast.expr]:
    """The module's top-level constants by name, with the expression each is defined by."""
    return {target.id: node.value for node in _tree(module).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def _loaded_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


@functools.cache
def _names_in(module: ModuleType, function: str) -> frozenset[str]:
    return frozenset(_loaded_names(_functions(module)[function]))


@functools.cache
def _callees(module: ModuleType, function: str) -> frozenset[tuple[ModuleType, str]]:
    """The functions `function` names: the module's own, and another pass module's as `module.function`."""
    own = _functions(module)
    found = {(module, name) for name in _names_in(module, function) if name in own}
    for n in ast.walk(own[function]):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            other = getattr(module, n.value.id, None)
            if (isinstance(other, ModuleType) and other.__name__.startswith(PASSES_PACKAGE)
                    and n.attr in _functions(other)):
                found.add((other, n.attr))
    return frozenset(found)


@functools.cache
def _reachable(module: ModuleType, name: str) -> frozenset[tuple[ModuleType, str]]:
    """`name` and every pass-module function it reaches by name."""
    seen, todo = set(), [(module, name)]
    while todo:
        item = todo.pop()
        if item not in seen:
            seen.add(item)
            todo.extend(_callees(*item))
    return frozenset(seen)


def _named_constants(module: ModuleType, reached: frozenset) -> set[str]:
    """The names the reached functions of `module` load, and those the constants among them are defined from."""
    assigned = _assignments(module)
    names = set().union(*(_names_in(m, f) for m, f in reached if m is module))
    todo = list(names)
    while todo:
        definition = assigned.get(todo.pop())
        for name in (_loaded_names(definition) - names) if definition is not None else ():
            names.add(name)
            todo.append(name)
    return names


def _calls(node: ast.AST, test) -> bool:
    return any(isinstance(n, ast.Call) and test(n.func) for n in ast.walk(node))


def _anchored_calls(reached: frozenset) -> list[tuple[ModuleType, ast.Call]]:
    return [(m, n) for m, f in reached for n in ast.walk(_functions(m)[f]) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == "rewrite_anchored"]


def _anchor_names(module: ModuleType, expr: ast.expr) -> set[str]:
    """The *ANCHORS constants an expression names, directly or through the module's functions it calls."""
    names = _loaded_names(expr)
    for name in [n for n in names if n in _functions(module)]:
        names |= set().union(*(_names_in(m, f) for m, f in _reachable(module, name)))
    return {name for name in names if name.endswith("ANCHORS")}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_anchors_are_declared_and_each_goes_to_a_binder_and_a_rewrite(family):
    reached = _reachable(family.module, "run")
    declared = {(m, name) for m in {m for m, _ in reached} for name in _assignments(m) if name.endswith("ANCHORS")}
    assert declared, f"{family.name}: no module constant named *ANCHORS"
    for module, name in declared:
        ops = getattr(module, name)
        assert isinstance(ops, tuple) and ops and all(isinstance(op, torch._ops.OpOverload) for op in ops), (
            f"{module.__name__}.{name} is not a tuple of OpOverloads: {ops!r}")
        assert name in _named_constants(module, reached), f"{module.__name__}.{name} is not reached from `run`"
    calls = _anchored_calls(reached)
    assert calls, f"{family.name}: `run` reaches no rewrite_anchored call"
    for module, call in calls:
        where = f"{module.__name__}:{call.lineno}"
        targets, binder, rewrite = call.args[2:5]
        assert not any(isinstance(n, ast.Tuple) for n in ast.walk(targets)), f"{where}: anchors written inline"
        assert _anchor_names(module, targets), f"{where}: the anchors name no *ANCHORS constant"
        assert isinstance(binder, ast.Name) and binder.id.startswith("_match"), f"{where}: binder not a _match*"
        assert isinstance(rewrite, ast.Name) and rewrite.id.startswith("_rewrite"), f"{where}: rewrite not a _rewrite*"
        assert any(_calls(_functions(m)[f], lambda fn: isinstance(fn, ast.Attribute) and fn.attr == "site")
                   for m, f in _reachable(module, rewrite.id)), f"{where}: {rewrite.id} records no site (ctx.site)"


def _stage_modules() -> list[ModuleType]:
    """Each family's module, and each pass module a family's `run` reaches that has a `run` of its own handing anchors
    to `rewrite_anchored` (sparse_attention's reaches sparse_attention_v4): each is checked on its own, so one
    module's verifier does not stand in for another's."""
    modules = []
    for family in FAMILIES:
        anchoring = {m for m, _ in _anchored_calls(_reachable(family.module, "run")) if "run" in _functions(m)}
        for module in [family.module, *sorted(anchoring - {family.module}, key=lambda m: m.__name__)]:
            if module not in modules:
                modules.append(module)
    return modules


STAGE_MODULES = _stage_modules()


def _short_name(module: ModuleType) -> str:
    return module.__name__.removeprefix(PASSES_PACKAGE)


@pytest.mark.parametrize("module", STAGE_MODULES, ids=_short_name)
def test_a_verifier_runs_verify_against_a_kernel_reference(module):
    verifiers = {(m, f) for m, f in _reachable(module, "run") if f.startswith("_verify")
                 and _calls(_functions(m)[f], lambda fn: isinstance(fn, ast.Name) and fn.id == "verify")}
    assert verifiers, f"{_short_name(module)}: `run` reaches no _verify* function that calls verify(...)"
    references = {name for m, f in set().union(*(_reachable(*v) for v in verifiers))
                  for name in _names_in(m, f) if name.endswith(REFERENCE_SUFFIXES)
                  and getattr(getattr(m, name, None), "__module__", "").startswith(KERNELS_PACKAGE)}
    assert references, f"{_short_name(module)}: its verifiers name no *_reference / *_math from dsfuse.kernels"


def test_a_module_that_runs_its_own_anchors_is_checked_on_its_own():
    names = [_short_name(module) for module in STAGE_MODULES]
    assert "sparse_attention_v4" in names and "norm_rope_quant_shared" in names, names


@pytest.mark.parametrize("module", STAGE_MODULES, ids=_short_name)
def test_docstring_ends_with_the_stages(module):
    stages = module.__doc__.strip().split("\n\n")[-1]
    assert stages.startswith("Stages"), f"{_short_name(module)}: the docstring's last paragraph is not its stages"
    anchors = {name for name in _assignments(module) if name.endswith("ANCHORS")}
    verifiers = {name for name in _functions(module) if name.startswith("_verify")}
    missing = sorted(name for name in anchors | verifiers if f"`{name}`" not in stages)
    assert not missing, f"{_short_name(module)}: the stages paragraph does not name {missing}"
