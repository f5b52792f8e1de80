"""Module float attributes as the constants they are, under `torch.compile(dynamic=True)`.

With `dynamic=True` Dynamo does not specialise Python floats: a module's `eps`, attention `scaling` or a class's
`softmax_scale` reaches the backend as a 0-d float64 graph input read through `.item()`, with no guard on its
value. The fused kernels take those numbers as compile-time constants and the passes recognise a norm or a scaled
product by them, so such a graph would keep none of those sites. The default `dynamic=None` bakes the same floats
in and guards on them. This asks Dynamo for the same, through its own mechanism for floats it cannot keep as
inputs: name them as to be specialised and restart the frame's analysis, which then traces them as constants
guarded on their values (changing one recompiles). Floats passed as arguments of the compiled call stay inputs:
their values are the caller's to vary, and a site that needs one as a constant is reported with that reason.
"""

from __future__ import annotations

import torch

# Links of a Dynamo source chain that mean "read off an object or a module's globals", not "passed in".
_HELD_SOURCES = ("AttrSource", "TypeSource", "TypeDictSource", "GlobalSource")


def _read_through_attribute(source) -> bool:
    """Whether the float was read as an attribute (`self.eps`, a class's `softmax_scale`, `self.config.rms_norm_eps`)
    or a global, not passed in as an argument of the compiled call."""
    from torch._dynamo import source as sources

    held = tuple(cls for name in _HELD_SOURCES if isinstance(cls := getattr(sources, name, None), type))
    while source is not None:
        if isinstance(source, held):
            return True
        source = getattr(source, "base", None)
    return False


def _float_symbol(node: torch.fx.Node) -> str | None:
    """The name of the SymFloat Dynamo read out of a 0-d float input with `.item()` (its `zf` symbol), else None."""
    memo = getattr(node.meta.get("example_value"), "item_memo", None)
    expr = getattr(getattr(memo, "node", None), "_expr", None)
    return getattr(expr, "name", None)


def specialise_module_floats(gm: torch.fx.GraphModule) -> None:
    """Restart Dynamo's analysis of this frame with the module floats among `gm`'s inputs specialised.

    Raises Dynamo's `TensorifyScalarRestartAnalysis` when there is one to specialise (the backend is called again
    with a graph where they are constants); returns when there is none, or when this torch lacks the mechanism."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return
    symbols = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            break
        arg = node.meta.get("grapharg")
        if arg is None or not getattr(arg, "pass_arg_as_tensor", False) or not _read_through_attribute(arg.source):
            continue
        symbol = _float_symbol(node)
        # once named, Dynamo removes the input on the restart; one it could not remove comes back and stays
        if symbol is not None and not TensorifyState.should_specialize(symbol):
            symbols.append(symbol)
    if symbols:
        for symbol in symbols:
            TensorifyState.specialize(symbol)
        raise TensorifyScalarRestartAnalysis
