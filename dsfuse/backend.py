"""The `dsfuse` torch.compile backend.

Registered through the `torch_dynamo_backends` entry point, so `backend="dsfuse"` works without
importing dsfuse. It runs Inductor with the dsfuse pass manager installed as the post-grad custom
pass; with every pass disabled it is plain Inductor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from . import report as _report
from .config import DECODE_MAX_TOKENS, BackendConfig, DsfuseConfigError, resolve_config
from .module_floats import specialise_module_floats
from .pass_manager import DsfusePassManager, sources_digest

TRAINING_NOTE = (
    "graph needs gradients: dsfuse passes rewrite inference graphs only "
    "(run under torch.no_grad() or torch.inference_mode()); compiled as plain Inductor"
)
CACHED_NOTE = "served from Inductor's FX graph cache; sites restored from dsfuse's record of that compile"
UNRECORDED_NOTE = "served from Inductor's FX graph cache without a dsfuse record of that compile: sites not counted"
DECODE_WITHOUT_GRAPHS_NOTE = (
    "decode graph (absorbed attention over the KV cache) compiled without CUDA graphs: a step is then bound by the "
    "host's launch work (H200, batch 1, T=8192: 12.3 ms per step, 1.55 ms with CUDA graphs); compile with "
    "options={'mode': 'reduce-overhead'} and decode from a transformers StaticCache"
)
V4_DECODE_WITHOUT_GRAPHS_NOTE = (
    "DeepSeek V4 decode graph compiled without CUDA graphs: a step is then bound by the host's launch work (H200, "
    "batch 1, context 8192: 7.5 ms per step, 1.24 ms of it on the GPU); decode with "
    "dsfuse.generation.generate_kwargs (a V4DecodeCache, options={'mode': 'reduce-overhead'}) to replay it as one"
)
DECODE_NOTES = {"dsfuse.absorbed_mla_attention": DECODE_WITHOUT_GRAPHS_NOTE,
                "dsfuse.compressed_attention": V4_DECODE_WITHOUT_GRAPHS_NOTE}


QUANTISED_OPS = ("fp8_linear", "fp8_grouped_linear")


def quantised_layers_note(gm: torch.fx.GraphModule) -> str:
    """Which implementation serves the graph's quantised layers: dsfuse's FP8 ops (counted), or, where the graph
    holds FP8 / FP4 weights and none of them, something else (named)."""
    calls = {name: 0 for name in QUANTISED_OPS}
    fp8_weights = False
    for node in gm.graph.nodes:
        for op in QUANTISED_OPS:  # the op or its overload packet: "dsfuse.fp8_linear(.default)"
            if node.op == "call_function" and str(node.target) in (f"dsfuse.{op}", f"dsfuse.{op}.default"):
                calls[op] += 1
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dtype == torch.float8_e4m3fn:
            fp8_weights = True
    served = ", ".join(f"{count} dsfuse.{op}" for op, count in calls.items() if count)
    if served:
        return f"quantised layers: {served} calls (dsfuse's FP8 kernels)"
    if fp8_weights:
        return "quantised layers: FP8 weights served by another implementation than dsfuse's (DSFUSE_FP8_KERNELS=hub?)"
    return ""


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A `UserWarning` the first time in a process (the report keeps every occurrence)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"dsfuse: {message}", UserWarning, stacklevel=3)


def _needs_grad(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _inductor_patches(cfg: BackendConfig, dynamic: bool | None) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    if cfg.mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(cfg.mode, dynamic))
    patches.update(cfg.inductor_options)
    if "post_grad_custom_post_pass" in patches:
        raise DsfuseConfigError(
            "options['inductor'] may not set post_grad_custom_post_pass: dsfuse installs its own pass there"
        )
    return patches


def _query_tokens(example_inputs: Sequence[Any]) -> int | None:
    """Tokens per sequence of a step: the length of its 2-D integer inputs (token ids, positions); None if symbolic.
    The inputs are the step's data: the model's parameters and buffers are left out by the caller."""
    lengths = [t.shape[1] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2
               and not t.dtype.is_floating_point and t.dtype != torch.bool]
    if not lengths or not all(isinstance(n, int) for n in lengths):
        return None
    return max(lengths)


def _dynamo_frame() -> tuple[int, int] | None:
    """(frame id, compile number of that frame) of the Dynamo compile calling the backend, else None."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    frame, attempt = getattr(compile_id, "frame_id", None), getattr(compile_id, "frame_compile_id", None)
    return (frame, attempt) if isinstance(frame, int) and isinstance(attempt, int) else None


def _is_weight(node: torch.fx.Node) -> bool:
    """A placeholder Dynamo lifted from a module's parameters or buffers (inlined nn modules): the model's weights,
    not the step's data."""
    from torch._dynamo.source import is_from_unspecialized_param_buffer_source

    source = getattr(node.meta.get("grapharg"), "source", None)
    return source is not None and is_from_unspecialized_param_buffer_source(source)


def _traced_tokens(gm: torch.fx.GraphModule) -> int | None:
    """`_query_tokens` of the graph as Dynamo traced it: its inputs' traced values keep a dynamic length as a symbol
    (the example inputs a backend gets are concrete tensors even then), so a graph for every length reads None.
    Integer weights are not tokens: V4's hash-routed MoE layer holds its token-to-expert table as a [vocab, top-k]
    int64 buffer, which would make every V4 decode step read top-k tokens."""
    return _query_tokens([node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")
                          if not _is_weight(node)])


def _record_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: BackendConfig,
                active: tuple[str, ...]) -> str:
    """The key of a Dynamo graph's record, for when AOTAutograd's cache serves the whole graph (then
    Inductor is not called and its FX graph key is not known). Inputs are described as Dynamo traced them: a dynamic
    graph, served from the cache at any size, keys its symbols, not the sizes of the call that compiled it."""
    traced = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    if len(traced) != len(example_inputs) or any(t is None for t in traced):
        traced = list(example_inputs)
    described = [
        (tuple(str(s) for s in t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
        for t in traced
    ]
    text = json.dumps([gm.code, described, active, sorted(map(str, cfg.inductor_options.items())), cfg.mode])
    return hashlib.sha256((text + sources_digest()).encode()).hexdigest()


def _records_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "dsfuse_sites"


def _save_records(key: str, sites: Sequence[_report.Site], near_misses: Sequence[_report.NearMiss]) -> None:
    """Keep what the passes did beside Inductor's cache, so a later cache hit can report it."""
    path = _records_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"sites": [dataclasses.asdict(s) for s in sites],
            "near_misses": [dataclasses.asdict(m) for m in near_misses]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _load_records(key: str) -> tuple[list[_report.Site], list[_report.NearMiss]] | None:
    path = _records_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    sites = [_report.Site(**{**s, "inputs": tuple(s["inputs"])}) for s in data["sites"]]
    return sites, [_report.NearMiss(**m) for m in data["near_misses"]]


class _RecordingInnerCompile:
    """Inductor's inner compile, recording the passes' sites under Inductor's own FX graph cache key.

    That key is computed from the AOT graph Inductor compiles, so two Dynamo graphs that differ only in
    spelling (argument names, say) share it: a hit for the second is answered with the first one's
    record. A Dynamo-level key could never find it.
    """

    def __init__(self, manager: DsfusePassManager):
        self.manager = manager
        self.calls = 0
        self.restored = False
        self.unrecorded = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        manager = self.manager
        runs, first_site, first_miss = manager.runs, len(manager.sites), len(manager.near_misses)
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        self.calls += 1
        key = getattr(compiled, "_fx_graph_cache_key", None)  # None when the FX graph cache is off
        if manager.runs > runs:
            if key is not None:
                _save_records(key, manager.sites[first_site:], manager.near_misses[first_miss:])
        elif key is not None and (records := _load_records(key)) is not None:
            manager.sites.extend(records[0])
            manager.near_misses.extend(records[1])
            self.restored = True
        else:
            self.unrecorded = True
        return compiled


def _recorded_dims(described: str) -> list[str]:
    """The dims of a site input as the pass recorded it (`name:dtype[d0xd1x...]`, dims concrete or symbolic)."""
    return described[described.rindex("[") + 1:-1].split("x")


def _is_decode_step(site: _report.Site) -> bool:
    """An attention of a few tokens over a cache: the absorbed MLA form (q [B, H, S, D], latent [B, 1, T, C]) or V4's
    (q [B, H, S, D], the K=V window [B, 1, T, D]) with T != S and S a number up to DECODE_MAX_TOKENS. T != S: the
    step attends over tokens from before its own, which only a KV cache holds (a prefill without a cache computes
    its keys from its own S tokens, so T is S, the same number or the same symbol). Few queries: a prompt chunk
    attends over the cache too, but it is GPU-bound and dsfuse's decode recipe leaves it without CUDA graphs."""
    if site.op not in DECODE_NOTES or len(site.inputs) < 2:
        return False
    queries, keys = _recorded_dims(site.inputs[0]), _recorded_dims(site.inputs[1])
    if len(queries) != 4 or len(keys) != 4 or not queries[2].isdigit():
        return False
    return int(queries[2]) <= DECODE_MAX_TOKENS and queries[2] != keys[2]


def _decode_without_graphs(sites: Sequence[_report.Site], example_inputs: Sequence[Any],
                           patches: Mapping[str, Any]) -> str | None:
    """The note for a CUDA decode graph (attention over a KV cache) that will not be captured, else None: worth
    telling the user, it costs several times its GPU time."""
    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    cudagraphs = patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs)
    if not cuda or cudagraphs:
        return None
    return next((DECODE_NOTES[site.op] for site in sites if _is_decode_step(site)), None)


def dsfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable:
    """Compile a Dynamo graph with Inductor plus the enabled dsfuse passes."""
    from torch._inductor.compile_fx import compile_fx

    from dsfuse.kernels import register_all

    cfg = resolve_config(options, mode)
    register_all()
    patches = _inductor_patches(cfg, dynamic=None)
    # the traced length, not the example inputs' (concrete even when the graph serves every length): a prompt
    # chunk's tail graph first compiled at a few tokens is not a decode step
    tokens = _traced_tokens(gm)
    if cfg.cudagraphs == "decode" and patches.get("triton.cudagraphs"):
        patches["triton.cudagraphs"] = tokens is not None and tokens <= DECODE_MAX_TOKENS
    note = ""
    manager = None
    if cfg.enabled and _needs_grad(example_inputs):
        note = TRAINING_NOTE
        _warn_once(TRAINING_NOTE)
    elif cfg.enabled:
        manager = DsfusePassManager(cfg.enabled)
        patches["post_grad_custom_post_pass"] = manager
        specialise_module_floats(gm)  # under dynamic=True: restarts Dynamo's trace with them constant
    graph_index = _report.start_graph(nodes=len(gm.graph.nodes), enabled=cfg.enabled if manager else (), note=note,
                                      tokens=tokens, frame=_dynamo_frame())
    if quantised := quantised_layers_note(gm):
        _report.annotate_graph(graph_index, quantised)
    if manager is None:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    else:
        inner = _RecordingInnerCompile(manager)
        compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        key = _record_key(gm, example_inputs, cfg, manager.active)
        if inner.calls == 0:  # AOTAutograd's cache served the graph: Inductor was never called
            if (records := _load_records(key)) is not None:
                manager.sites, manager.near_misses = records
                inner.restored = True
            else:
                inner.unrecorded = True
        if inner.unrecorded:
            _report.annotate_graph(graph_index, UNRECORDED_NOTE)
        else:
            _save_records(key, manager.sites, manager.near_misses)
            if inner.restored:
                _report.annotate_graph(graph_index, CACHED_NOTE)
        for site in manager.sites:
            _report.record_site(_report.Site(**{**site.__dict__, "graph": graph_index}))
        for miss in manager.near_misses:
            _report.record_near_miss(_report.NearMiss(**{**miss.__dict__, "graph": graph_index}))
        _report.note_sites_lost_to_recompile(graph_index)
        note = _decode_without_graphs(manager.sites, example_inputs, patches)
        if note is not None:
            _report.annotate_graph(graph_index, note)
            _report.log.warning("graph %d: %s", graph_index, note)
    return compiled
