"""Triton's interpreter patches `triton.language` for the kernel it launches, and again, in full, at every call of a
`@triton.jit` function inside that kernel, its own (`tl.sum`, `tl.zeros`, ...) included: a scan of every member of
`tl`, `tl.core`, `tl.math` and `tl.tensor`, about 40 % of an interpreted kernel's time in the indexer's tests. Once
the launch has patched every language module a function sees, patching them again changes nothing (patched members
are no longer builtins, and the rest are set to the same functions again), and the launch's restore undoes the first
patching either way. This skips the repeats for the tests.

Only where the interpreter has the shape this relies on (triton 3.6 - 3.9: a module-level `_patch_lang` that the
launch, `GridExecutor.__call__`, and each function call look up); otherwise the interpreter is left as it is."""

import functools
import inspect


class _NothingToRestore:
    def restore(self) -> None:
        pass


@functools.cache
def _languages(fn) -> frozenset[int]:
    import triton.language as tl

    modules = (value for value in fn.__globals__.values() if inspect.ismodule(value))
    return frozenset(id(module) for module in modules if module in (tl, tl.core))


def patch_the_language_once_per_launch() -> None:
    from triton.runtime import interpreter

    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if launch is None or patch is None or getattr(patch, "once_per_launch", False):
        return
    patched = []  # per launch in progress: the language modules patched so far

    def patch_once(fn):
        languages = _languages(fn)
        if patched and languages and languages <= patched[-1]:
            return _NothingToRestore()
        scope = patch(fn)
        if patched:
            patched[-1] |= languages
        return scope

    def launch_patching_once(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
