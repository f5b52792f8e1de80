"""`model` and `ablate`: the whole model's prefill and its decode with a KV cache, eager / Inductor / dsfuse.

Every configuration is checked before it is timed: dsfuse with all passes off must reproduce Inductor
bit for bit, and every compiled model is compared with eager. Times are medians of
`triton.testing.do_bench` (CUDA) or of wall-clock repeats (CPU); an out-of-memory configuration is
reported as such.

Decode (`--mode decode`): each configuration fills a KV cache of T context tokens with its own prefill
(`--prefill-cache same`; a configuration that runs out of memory there decodes from a cache that dsfuse
filled, and the row says so), or every configuration decodes from the one dsfuse-filled cache
(`--prefill-cache dsfuse`, quicker: one prefill per batch and context). A timed step decodes one token per
sequence at position T: HF's `DynamicCache` grows by `torch.cat`, so the cache's tensors are put back before
every step and each step sees exactly T cached tokens. The cache length is marked dynamic, so one compiled
decode graph serves every length; the graphs compiled while the cache really grows (`--growing-steps`
appended tokens) are counted and printed, so a recompile per step cannot hide. The CUDA-graph configurations
decode from HF's `StaticCache` instead (as `generate` does under `torch.compile`): a graph replay needs fixed
shapes and buffer addresses, which a growing `DynamicCache` cannot give. The static cache holds the same T
tokens (copied from the filled dynamic cache) with room for the appended ones, and its write position is put
back to T before every step.
"""

from __future__ import annotations

import inspect
import json
import time

import torch

import dsfuse
from dsfuse.bench.measure import (CONFIGS, CUDA_GRAPH_CONFIGS, compile_with, environment, error_text,
                                  free_device_memory, graph_count, loaded_with_weight_bytes, profile_stages,
                                  resolve_configs, time_ms)
from dsfuse.bench.report import ablation_summary, decode_notes, progress
from dsfuse.bench.source import load_model, source_label
from dsfuse.models.presets import is_v4_preset


def bench_model(args) -> dict:
    """`model`: prefill (`--mode prefill`), decode with a KV cache (`--mode decode`) or both, one model build."""
    started = time.perf_counter()
    cuda = args.device.startswith("cuda")
    cast = getattr(args, "cast", None)

    def load():
        model = load_model(args)
        return model if cast is None else model.to(getattr(torch, cast))

    model, weights = loaded_with_weight_bytes(load, cuda)
    results = {"env": environment(), "preset": source_label(args), "dtype": args.dtype, "cast": cast,
               "batch": args.batch, "mode": args.mode, "runs": []}
    if cuda:
        results["weights_gib"] = round(weights / 2**30, 2)
    print(f"# {results['env']} preset={results['preset']} dtype={args.dtype} cast={cast} mode={args.mode} "
          f"weights={results.get('weights_gib', '-')} GiB", flush=True)
    if args.mode in ("prefill", "both"):
        _bench_prefill(model, args, results)
    if args.mode in ("decode", "both"):
        results.update(decode=[], decode_batches=args.decode_batch, contexts=args.context,
                       prefill_cache=args.prefill_cache, growing_steps=args.growing_steps)
        _bench_decode(model, args, results)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"# {args.command} finished in {results['wall_s']} s", flush=True)
    return results


def _bench_prefill(model, args, results: dict) -> None:
    cuda = args.device.startswith("cuda")
    bar = progress(len(args.seq) * len(args.configs), f"{source_label(args)} prefill")
    for seq in args.seq:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=args.device,
                            generator=torch.Generator(args.device).manual_seed(seq))
        outputs: dict[str, torch.Tensor] = {}
        for name, (backend, options) in args.configs.items():
            bar.set_postfix_str(f"S={seq} {name}")
            row = {"seq": seq, "config": name, "logits": args.logits}
            try:
                fn = _prefill_step(compile_with(model, backend, options), args.logits, name in CUDA_GRAPH_CONFIGS,
                                   without_cache=is_v4_preset(model.config))
                dsfuse.reset_report()
                if cuda:
                    free_device_memory(cuda)
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with torch.no_grad():
                    start = time.perf_counter()
                    logits = fn(ids).logits
                    if cuda:
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - start, 2)
                    if backend == "dsfuse":
                        row["dsfuse_pass_s"] = round(dsfuse.report().pass_seconds, 2)
                    if cuda:
                        row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
                    logits = logits.float()  # a copy, after the peak: a CUDA-graph replay reuses its output memory
                    row["ms"] = time_ms(lambda: fn(ids), args.device, args.rep_ms)
                    if name == "inductor":
                        row["deterministic"] = bool(torch.equal(fn(ids).logits.float(), logits))
                row["tok_per_s"] = args.batch * seq / row["ms"] * 1e3
                if args.profile and cuda:
                    with torch.no_grad():
                        row["profile"] = profile_stages(lambda: fn(ids))
                if backend == "dsfuse":
                    row["rewritten"] = dsfuse.report().counts
                    row["near_misses"] = sorted({f"{m.pass_name}: {m.reason}" for m in dsfuse.report().near_misses})
                outputs[name] = logits
                del logits
            except torch.OutOfMemoryError:
                row["ms"] = None
                row["error"] = "out of memory"
            except Exception as err:  # a broken configuration is reported, the others still run
                row["ms"] = None
                row["error"] = error_text(err)
            results["runs"].append(row)
            _print_row(row)
            bar.update()
        _check_parity(outputs, seq, results)
        outputs.clear()
        free_device_memory(cuda)
    bar.close()
    _print_table(results)


def _prefill_step(fn, logits: str, cudagraphs: bool, without_cache: bool = False):
    """One prefill call: all positions' logits, or only the last one's (`logits_to_keep=1`, what `generate`
    asks for). Under CUDA graphs each call starts a new graph-tree step (its outputs are not read later).
    `without_cache`: pass `use_cache=False` (V4's prefill: with a cache HF V4 runs its compressors' cache paths)."""
    keep = {"logits_to_keep": 1} if logits == "last" else {}
    if without_cache:
        keep["use_cache"] = False

    def step(ids):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(ids, **keep)

    return step


PRINTED_KERNELS = 16


def _print_row(row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    if "profile" in row:
        prof = row["profile"]
        shares = ", ".join(f"{k} {v:.1%}" for k, v in prof["dsfuse_ops_share"].items())
        print(f"  profile: {prof['gpu_ms']:.2f} ms GPU in {prof.get('kernel_launches', '?')} kernel launches; fused "
              f"ops: {shares or 'none'}", flush=True)
        launches = prof.get("launches_by_kernel", {})
        for kernel, ms in prof["top_kernels_ms"][:PRINTED_KERNELS]:
            print(f"    {ms:8.3f} ms {launches.get(kernel, '?'):>4}x  {kernel}", flush=True)


# The configuration that fills the KV cache for configurations whose own prefill runs out of memory
# (and for every configuration under `--prefill-cache dsfuse`): the only one whose memory is linear in T.
FALLBACK_PREFILL = "dsfuse"

_CACHE_FIELDS = ("keys", "values", "indexer_keys")  # per layer: latent K, rotary K, V3.2 indexer keys


def _cache_argument(model) -> str:
    """transformers 5.24 calls the cache argument `cache` (`past_key_values` is its deprecated alias)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class FilledCache:
    """A `DynamicCache` filled with T context tokens, and its tensors so it can be put back to exactly T.

    HF's dynamic cache layers grow by `torch.cat` and never write into their tensors, so keeping references to
    the per-layer tensors (latent keys, rotary keys and the indexer's own key cache) is a complete snapshot.
    """

    def __init__(self, cache, prefill_by: str, prefill_s: float):
        self.cache, self.prefill_by, self.prefill_s = cache, prefill_by, prefill_s
        self.tensors = [{field: getattr(layer, field) for field in _CACHE_FIELDS
                         if isinstance(getattr(layer, field, None), torch.Tensor)} for layer in cache.layers]
        self.length = cache.get_seq_length()
        self.reference: torch.Tensor | None = None  # eager logits of the first decode step, once computed
        self.reference_tried = False

    def restore(self) -> None:
        for layer, saved in zip(self.cache.layers, self.tensors):
            for field, tensor in saved.items():
                setattr(layer, field, tensor)

    def mark_length_dynamic(self) -> None:
        """One compiled decode graph for every cache length, instead of one per length."""
        for saved in self.tensors:
            for tensor in saved.values():
                torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 2)


class StaticFilledCache:
    """The T tokens of a filled dynamic cache, copied into HF's `StaticCache` of `max_len` positions.

    Its buffers keep their addresses (HF marks them static), so a CUDA graph can replay the decode step; the
    step writes in place at the layer's write position, so putting the cache back to T means resetting that
    position (the tokens written past T are masked out by the causal mask of the next step at T).
    """

    def __init__(self, source: FilledCache, model, max_len: int):
        from transformers import StaticCache

        self.source, self.length = source, source.length
        self.prefill_by, self.prefill_s = source.prefill_by, source.prefill_s
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        for layer, saved in zip(self.cache.layers, source.tensors):
            layer.lazy_initialization(saved["keys"], saved["values"])
            layer.keys[:, :, :self.length].copy_(saved["keys"])
            layer.values[:, :, :self.length].copy_(saved["values"])
            if "indexer_keys" in saved:
                layer.lazy_initialization_indexer(saved["indexer_keys"])
                layer.indexer_keys[:, :self.length].copy_(saved["indexer_keys"])
        self.restore()

    def restore(self) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.length)
            if getattr(layer, "indexer_cumulative_length", None) is not None:
                layer.indexer_cumulative_length.fill_(self.length)

    def mark_length_dynamic(self) -> None:
        """Nothing to mark: a static cache has one shape for every length."""


def _prefill(fn, model, batch: int, context: int, prefill_by: str, device: str) -> FilledCache:
    """Run the T context tokens through `fn` once, keeping only the last position's logits."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device,
                        generator=torch.Generator(device).manual_seed(context + batch))
    torch._dynamo.maybe_mark_dynamic(ids, 1)  # one prefill graph for every context length
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.no_grad():
        fn(ids, use_cache=True, logits_to_keep=1, **{_cache_argument(model): cache})
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    filled = FilledCache(cache, prefill_by, round(time.perf_counter() - start, 2))
    if filled.length != context:
        raise RuntimeError(f"prefill left {filled.length} tokens in the cache, expected {context}")
    return filled


class _DecodeCaches:
    """The fallback caches by (batch, context), each filled once per run, and eager reference logits."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.fallback: dict[tuple[int, int], FilledCache] = {}
        self.prefiller = None

    def fallback_cache(self, batch: int, context: int, fn=None) -> FilledCache:
        """The cache `FALLBACK_PREFILL` fills (through `fn` when that is already this configuration)."""
        key = (batch, context)
        if key not in self.fallback:
            if fn is None:
                if self.prefiller is None:
                    backend, options = CONFIGS[FALLBACK_PREFILL]
                    self.prefiller = self.model if backend is None else torch.compile(
                        self.model, backend=backend, **({"options": options} if options else {}))
                fn = self.prefiller
            self.fallback[key] = _prefill(fn, self.model, batch, context, FALLBACK_PREFILL, self.args.device)
        return self.fallback[key]

    def reference(self, filled: FilledCache, tokens, positions) -> torch.Tensor | None:
        """Eager logits of the first decode step from `filled` (None where eager runs out of memory)."""
        if not filled.reference_tried:
            filled.reference_tried = True
            try:
                filled.restore()
                with torch.no_grad():
                    logits = self.model(tokens, position_ids=positions, use_cache=True,
                                        **{_cache_argument(self.model): filled.cache}).logits
                filled.reference = logits.float()
            except torch.OutOfMemoryError:
                free_device_memory(self.args.device.startswith("cuda"))
            finally:
                filled.restore()
        return filled.reference


def _decode_cache(caches: _DecodeCaches, fn, name: str, backend, options, batch: int, context: int,
                  row: dict) -> FilledCache:
    """This configuration's own filled cache, or the fallback one where it cannot fill one (noted in `row`)."""
    args = caches.args
    is_fallback_config = (backend, options) == CONFIGS[FALLBACK_PREFILL]
    if args.prefill_cache == FALLBACK_PREFILL or is_fallback_config:
        return caches.fallback_cache(batch, context, fn if is_fallback_config else None)
    try:
        return _prefill(fn, caches.model, batch, context, name, args.device)
    except torch.OutOfMemoryError:
        row["prefill_error"] = f"{name} prefill out of memory"
    free_device_memory(args.device.startswith("cuda"))
    return caches.fallback_cache(batch, context)


# Per configuration, decode compiles prefill graphs (its own and the fallback's, per batch size) and a decode graph
# per batch size; with several batch sizes that passes Dynamo's default limit of 8 graphs per function, past which
# Dynamo would silently run the model eagerly.
DECODE_RECOMPILE_LIMIT = 64


def _bench_decode(model, args, results: dict) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
    with config.patch({name: max(DECODE_RECOMPILE_LIMIT, getattr(config, name))}):
        _bench_decode_configs(model, args, results)


def _bench_decode_configs(model, args, results: dict) -> None:
    cuda = args.device.startswith("cuda")
    cache_argument = _cache_argument(model)
    caches = _DecodeCaches(model, args)
    shapes = [(batch, context) for batch in args.decode_batch for context in args.context]
    bar = progress(len(shapes) * len(args.configs), f"{source_label(args)} decode")
    for name, (backend, options) in args.configs.items():
        fn = compile_with(model, backend, options)
        for batch, context in shapes:
            bar.set_postfix_str(f"B={batch} T={context} {name}")
            row = {"batch": batch, "context": context, "config": name}
            filled = None
            cudagraphs = name in CUDA_GRAPH_CONFIGS
            row["cache"] = "static" if cudagraphs else "dynamic"
            try:
                if cudagraphs:  # its own prefill would record CUDA graphs of a growing cache: fill it from dsfuse's
                    filled = StaticFilledCache(caches.fallback_cache(batch, context), model,
                                               context + args.growing_steps + 1)
                else:
                    filled = _decode_cache(caches, fn, name, backend, options, batch, context, row)
                row["prefill_by"], row["prefill_s"] = filled.prefill_by, filled.prefill_s
                sites_before = dsfuse.report().counts
                _time_decode(fn, filled, caches, cache_argument, args, row, compiled=backend is not None,
                             cudagraphs=cudagraphs)
                if backend == "dsfuse" and row.get("graphs_first_call"):
                    # sites in the decode graph compiled for this row (prefills compiled meanwhile excluded)
                    row["rewritten"] = {pass_name: count - sites_before[pass_name]
                                        for pass_name, count in dsfuse.report().counts.items()}
            except torch.OutOfMemoryError:
                row["ms"] = None
                row["error"] = "out of memory" + (" in the prefill" if filled is None else "")
            except Exception as err:  # a broken configuration is reported, the others still run
                row["ms"] = None
                row["error"] = error_text(err)
            finally:
                if filled is not None:
                    filled.restore()
            del filled
            free_device_memory(cuda)
            results["decode"].append(row)
            _print_row(row)
            bar.update()
    bar.close()
    _print_decode_table(results)


def _time_decode(fn, filled: FilledCache | StaticFilledCache, caches: _DecodeCaches, cache_argument: str, args,
                 row: dict, compiled: bool, cudagraphs: bool = False) -> None:
    """First call, `--growing-steps` appended tokens (counting recompiles), then steps timed at length T.
    Under CUDA graphs each step starts a new graph-tree step: the previous step's outputs are not read again."""
    cuda = args.device.startswith("cuda")
    batch, context = row["batch"], row["context"]
    tokens = torch.randint(0, caches.model.config.vocab_size, (batch, 1), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(batch * context + 1))
    positions = torch.full((batch, 1), context, device=args.device, dtype=torch.long)
    filled.mark_length_dynamic()

    def step(offset: int = 0):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(tokens, position_ids=positions + offset, use_cache=True, **{cache_argument: filled.cache})

    def timed_step():
        filled.restore()
        return step()

    if cuda:
        free_device_memory(cuda)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    graphs = graph_count()
    with torch.no_grad():
        start = time.perf_counter()
        logits = timed_step().logits.float()
        if cuda:
            torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - start, 2)
        counts = {"graphs_first_call": graph_count() - graphs}
        graphs = graph_count()
        for offset in range(1, args.growing_steps + 1):
            step(offset)
        counts["recompiles_growing"] = graph_count() - graphs
        graphs = graph_count()
        row["ms"] = time_ms(timed_step, args.device, args.rep_ms)
        counts["recompiles_timed"] = graph_count() - graphs
        if compiled:
            row.update(counts)
        if cuda:
            row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        if args.profile and cuda:
            row["profile"] = profile_stages(timed_step)
    row["tok_per_s"] = batch / row["ms"] * 1e3
    filled.restore()
    source = getattr(filled, "source", filled)  # eager's reference decodes from the dynamic cache
    if not compiled:
        source.reference, source.reference_tried = logits, True
    reference = caches.reference(source, tokens, positions)
    if reference is not None:
        row["rel_l2_vs_eager"] = ((logits - reference).norm() / reference.norm()).item()


def _print_decode_table(results: dict) -> None:
    base = {(r["batch"], r["context"]): r["ms"] for r in results["decode"] if r["config"] == "inductor" and r.get("ms")}
    print(f"\ndecode: ms per step (one new token per sequence), cache put back to T before each step; "
          f"recompiles counted over {results['growing_steps']} appended tokens")
    print(f"{'B':>3} {'T':>6} {'config':<19} {'cache':<7} {'prefill by':<11} {'ms/step':>9} {'tok/s':>9} {'vs Ind.':>8} "
          f"{'peak GiB':>9} {'recompiles':>10} {'rel_l2 eager':>12}  notes")
    for r in results["decode"]:
        ms = r.get("ms")
        key = (r["batch"], r["context"])
        ratio = f"{base[key] / ms:.2f}x" if ms and key in base else "-"
        notes = decode_notes(r, results["growing_steps"])
        print(f"{r['batch']:>3} {r['context']:>6} {r['config']:<19} {r.get('cache', 'dynamic'):<7} "
              f"{r.get('prefill_by', '-'):<11} "
              f"{'-' if ms is None else round(ms, 3)!s:>9} {'-' if ms is None else round(r['tok_per_s'], 1)!s:>9} "
              f"{ratio:>8} {r.get('peak_extra_gib', '-')!s:>9} {r.get('recompiles_growing', '-')!s:>10} "
              f"{r.get('rel_l2_vs_eager', float('nan')):>12.3e}  {notes}")


def ablation_configs(passes: list[str]) -> list[str]:
    """Eager (the parity reference), Inductor, all passes on, each pass off in turn, each pass alone."""
    return ["eager", "inductor", "dsfuse", *(f"no:{name}" for name in passes), *(f"only:{name}" for name in passes)]


def bench_ablate(args) -> dict:
    """`ablate`: the `model` prefill over `ablation_configs`, plus the per-pass contribution table."""
    args.mode = "prefill"
    args.configs = resolve_configs(ablation_configs(args.passes))
    results = bench_model(args)
    results["kind"] = "ablate"
    results["passes"] = list(args.passes)
    results["ablation"] = ablation_summary(results)
    _print_ablation(results)
    return results


def _print_ablation(results: dict) -> None:
    print(f"\n{'S':>6} {'pass':<17} {'sites':>5} {'alone ms':>9} {'alone vs Ind.':>13} {'without ms':>10} "
          f"{'all on / without':>16}")
    for r in results["ablation"]:
        print(f"{r['seq']:>6} {r['pass']:<17} {'-' if r['sites'] is None else r['sites']!s:>5} "
              f"{_number(r['alone_ms'], '.3f'):>9} {_number(r['alone_vs_inductor'], '.2f', 'x'):>13} "
              f"{_number(r['without_ms'], '.3f'):>10} {_number(r['all_vs_without'], '.2f', 'x'):>16}")


def _number(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _check_parity(outputs: dict[str, torch.Tensor], seq: int, results: dict) -> None:
    reference = outputs.get("eager")
    for row in results["runs"]:
        if row["seq"] != seq or row["config"] not in outputs:
            continue
        out = outputs[row["config"]]
        if reference is not None:
            row["rel_l2_vs_eager"] = ((out - reference).norm() / reference.norm()).item()
        if row["config"] == "dsfuse-off" and "inductor" in outputs:
            row["bitwise_equal_to_inductor"] = bool(torch.equal(out, outputs["inductor"]))


def _print_table(results: dict) -> None:
    base = {(r["seq"]): r["ms"] for r in results["runs"] if r["config"] == "inductor" and r.get("ms")}
    width = max([11, *(len(r["config"]) for r in results["runs"])])
    print(f"\n{'S':>6} {'config':<{width}} {'ms':>9} {'tok/s':>10} {'vs Inductor':>11} {'peak GiB':>9} "
          f"{'rel_l2 eager':>12}  notes")
    for r in results["runs"]:
        ms = r.get("ms")
        ratio = f"{base[r['seq']] / ms:.2f}x" if ms and r["seq"] in base else "-"
        notes = r.get("error", "")
        if r.get("logits") == "last":
            notes += "last logits only "
        if "deterministic" in r:
            notes += f"run twice bitwise equal: {r['deterministic']}"
        if "bitwise_equal_to_inductor" in r:
            notes += f"bitwise==inductor: {r['bitwise_equal_to_inductor']}"
        if r.get("rewritten"):
            notes += " rewritten " + ",".join(f"{k}={v}" for k, v in r["rewritten"].items() if v)
        if r.get("near_misses"):
            notes += " NEAR-MISSES " + " | ".join(r["near_misses"])
        print(f"{r['seq']:>6} {r['config']:<{width}} {ms if ms is None else round(ms, 2)!s:>9} "
              f"{round(r['tok_per_s']) if ms else '-'!s:>10} {ratio:>11} {r.get('peak_extra_gib', '-')!s:>9} "
              f"{r.get('rel_l2_vs_eager', float('nan')):>12.3e}  {notes}")


