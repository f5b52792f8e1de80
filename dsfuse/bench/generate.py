"""`python -m dsfuse.bench generate`: whole `model.generate(...)` calls, eager / Inductor / dsfuse in one process.

    python -m dsfuse.bench generate --preset v32-real-2l --prompt 2048 8192 32768 --batch 1 8 --json g.json
    python -m dsfuse.bench generate --preset tiny --device cpu --prompt 17 29 --new-tokens 4   # smoke run

Configurations: `eager` (static cache, nothing compiled), `inductor` (transformers' default recipe: a static cache
and `CompileConfig()`, which compiles the decode step with Inductor in "reduce-overhead" mode and runs the prefill
eagerly) and `dsfuse` (`dsfuse.generation.generate_kwargs`: chunked prefill and decode through dsfuse, decode
under CUDA graphs). DeepSeek V4 has no static cache (so transformers' recipe cannot compile its decode step
once): `eager` prefills and decodes with HF's growing V4 cache, `dsfuse` is `generate_kwargs` (prefill chunks and
decode steps through dsfuse, from `dsfuse.v4_cache.V4DecodeCache`, the decode step as a CUDA graph) and `inductor`
the same chunks, cache and compiled calls with Inductor in "reduce-overhead" mode (CUDA graphs for every call:
Inductor alone cannot keep them to the decode steps).
Greedy decoding, end-of-sequence ignored, so every call decodes exactly the asked tokens.

Per configuration, batch and prompt length: time to first token (a `generate` of one new token: the prefill),
ms per decoded token (the difference of an N-token and a one-token call over N - 1), ms per step (the median and
the longest time from one new token to the next inside the N-token calls, marked by a stopping criterion that never
stops: the decode speedup compares these where both sides have them), tokens/s, the peak memory
beyond the weights, and the generated tokens against eager's (equal, or the length of the prefix that matches,
the shortest over the batch); ms per token is left out, with the reason, where the difference of the two calls is
within their repeats' spread. `--padded` left-pads row i of a batch by i * prompt / (2 * batch) tokens. Every
call is run once before it is timed (compiles), then timed `--repeats` times (median); the static cache holds
the prompt plus the new tokens.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import statistics
import time

import torch

from dsfuse.bench.measure import (environment, error_text, free_device_memory, graph_count, kernel_summary,
                                  kernel_times, loaded_with_weight_bytes)
from dsfuse.bench.source import add_source_arguments, load_model, source_label

GENERATE_CONFIGS = ("eager", "inductor", "dsfuse")


def prompt_batch(vocab: int, batch: int, length: int, padded: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [batch, length] and their attention mask; `padded`: row i left-padded by i*length/(2*batch)."""
    gen = torch.Generator(device).manual_seed(length * 31 + batch)
    ids = torch.randint(1, vocab, (batch, length), device=device, generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):
            pad = row * length // (2 * batch)
            ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def matching_prefix(tokens: torch.Tensor, reference: torch.Tensor, prompt: int) -> int:
    """New tokens equal to the reference's from the first on, the shortest over the batch."""
    new, ref = tokens[:, prompt:], reference[:, prompt:]
    length = min(new.shape[1], ref.shape[1])
    same = (new[:, :length] == ref[:, :length]).to(torch.int64)
    return int(same.cumprod(dim=1).sum(dim=1).min())


class Recipe:
    """One configuration's keyword arguments for `generate`, built once per batch size (the cache is reused)."""

    def __init__(self, name: str, model, batch: int, max_cache_len: int, chunk: int, cpu: bool):
        from transformers import CompileConfig

        from dsfuse.generation import is_v4

        self.name, self.model, self.batch, self.max_cache_len = name, model, batch, max_cache_len
        self.chunk, self.cpu, self.cache = chunk, cpu, None
        self.v4 = is_v4(model)
        # HF V4 has no static cache: eager runs on its growing cache, Inductor on dsfuse's recipe (V4DecodeCache)
        self.static = {} if self.v4 else dict(cache_implementation="static", max_cache_len=max_cache_len)
        if name == "inductor" and not self.v4:
            config = CompileConfig()
            if cpu:
                config._compile_all_devices = True
            self.static["compile_config"] = config
        elif name == "eager":
            self.static["disable_compile"] = True
        elif name not in ("dsfuse", "inductor"):
            raise ValueError(f"unknown generate config {name!r}; valid: {', '.join(GENERATE_CONFIGS)}")

    def kwargs(self) -> dict:
        if self.name == "inductor" and self.v4:
            from transformers import CompileConfig

            from dsfuse.generation import v4_generate_kwargs

            kwargs = v4_generate_kwargs(self.model, self.batch, self.max_cache_len, cache=self.cache,
                                        prefill_chunk_size=self.chunk, compile_all_devices=self.cpu)
            # Inductor alone has no decode-only CUDA graphs: "reduce-overhead" records the prefill chunks too
            kwargs["compile_config"] = CompileConfig(backend="inductor", mode="reduce-overhead")
            kwargs["compile_config"]._compile_all_devices = self.cpu
            self.cache = kwargs["cache"]
            return kwargs
        if self.name != "dsfuse":
            return dict(self.static)
        from dsfuse.generation import generate_kwargs

        kwargs = generate_kwargs(self.model, self.batch, self.max_cache_len, cache=self.cache,
                                 prefill_chunk_size=self.chunk, compile_all_devices=self.cpu)
        self.cache = kwargs["cache"]
        return kwargs


class StepClock:
    """A stopping criterion that never stops and marks each new token as `generate` produces it: a CUDA event on
    the current stream, or the host clock on CPU. The gaps between marks are the decode steps' own times, free of
    the prefill's run-to-run spread that a difference of whole calls carries (`decode_step_ms`)."""

    def __init__(self, batch: int, device: str, cuda: bool):
        self.cuda = cuda
        self.never = torch.zeros(batch, dtype=torch.bool, device=device)
        self.marks: list = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self.marks.append(mark)
        else:
            self.marks.append(time.perf_counter())
        return self.never

    def step_ms(self) -> list[float]:
        """ms from each token's mark to the next (the first mark ends the prefill); on CUDA after a synchronize."""
        if self.cuda:
            return [first.elapsed_time(second) for first, second in zip(self.marks, self.marks[1:])]
        return [(second - first) * 1e3 for first, second in zip(self.marks, self.marks[1:])]


def _timed_generate(model, recipe: Recipe, ids, mask, new_tokens: int, cuda: bool,
                    clock: StepClock | None = None) -> tuple[float, torch.Tensor]:
    kwargs = recipe.kwargs()
    if clock is not None:
        from transformers import StoppingCriteriaList

        kwargs["stopping_criteria"] = StoppingCriteriaList([clock])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, out


def bench_generate(args) -> dict:
    import dsfuse
    started = time.perf_counter()
    cuda = args.device.startswith("cuda")
    model, weights = loaded_with_weight_bytes(lambda: load_model(args), cuda)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    resident = torch.cuda.memory_allocated() if cuda else 0
    results = {"env": environment(), "kind": "generate", "preset": source_label(args), "dtype": args.dtype,
               "prompts": args.prompt, "batches": args.batch, "padded": args.padded, "new_tokens": args.new_tokens,
               "prefill_chunk": args.chunk, "weights_gib": round(weights / 2**30, 2), "runs": []}
    print(f"# {results['env']} preset={results['preset']} dtype={args.dtype} generate", flush=True)
    for batch in args.batch:
        references: dict[int, torch.Tensor] = {}
        for name in args.configs:
            for prompt in args.prompt:
                # Each prompt gets a cache of its own length (a longer one would slow the decode of HF's attention
                # over every cached position), so each compiles afresh here; tests/test_generate.py shows that
                # prompts of new lengths under one cache length do not recompile.
                torch._dynamo.reset()
                recipe = Recipe(name, model, batch, prompt + args.new_tokens, args.chunk, not cuda)
                row = {"config": name, "batch": batch, "prompt": prompt, "padded": args.padded}
                ids, mask = prompt_batch(model.config.vocab_size, batch, prompt, args.padded, args.device)
                try:
                    dsfuse.reset_report()
                    skips = _cudagraph_skips()
                    first_s, out = _timed_generate(model, recipe, ids, mask, args.new_tokens, cuda)
                    _timed_generate(model, recipe, ids, mask, 1, cuda)
                    row["first_call_s"] = round(first_s / 1e3, 2)
                    if name == "dsfuse":
                        row["rewritten"] = dsfuse.report().counts
                    graphs = graph_count()
                    if cuda:
                        free_device_memory(cuda)
                        torch.cuda.reset_peak_memory_stats()
                    ttft = [_timed_generate(model, recipe, ids, mask, 1, cuda)[0] for _ in range(args.repeats)]
                    clocks = [StepClock(batch, args.device, cuda) for _ in range(args.repeats)]
                    full = [_timed_generate(model, recipe, ids, mask, args.new_tokens, cuda, clock)[0]
                            for clock in clocks]
                    row["recompiles_timed"] = graph_count() - graphs
                    row["cudagraph_skips"] = _cudagraph_skips() - skips
                    if cuda:
                        row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - resident) / 2**30, 2)
                    row["ttft_ms"] = statistics.median(ttft)
                    row["generate_ms"] = statistics.median(full)
                    row["ms_per_token"], unresolved = decode_step_ms(ttft, full, args.new_tokens)
                    if unresolved:
                        row["decode_unresolved"] = unresolved
                    steps = [ms for clock in clocks for ms in clock.step_ms()]
                    if steps:
                        row["step_ms_median"] = statistics.median(steps)
                        row["step_ms_max"] = max(steps)
                    row["tok_per_s"] = batch * args.new_tokens / row["generate_ms"] * 1e3
                    if args.profile and args.new_tokens > 1:
                        call = functools.partial(_timed_generate, model, recipe, ids, mask, cuda=cuda)
                        if cuda:
                            row["step_profile"] = decode_step_profile(lambda tokens: call(new_tokens=tokens),
                                                                      args.new_tokens)
                            if "step_ms_median" in row:  # what of a step the GPU spends waiting for the host
                                row["step_gpu_idle_ms"] = row["step_ms_median"] - row["step_profile"]["gpu_ms"]
                        row["host_profile"] = host_step_profile(lambda tokens: call(new_tokens=tokens),
                                                                args.new_tokens)
                    if name == "eager":
                        references[prompt] = out
                    elif prompt in references:
                        row["tokens_equal_eager"] = bool(torch.equal(out, references[prompt]))
                        row["matching_prefix"] = matching_prefix(out, references[prompt], prompt)
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory"
                except Exception as err:  # a broken configuration is reported, the others still run
                    row["error"] = error_text(err)
                del recipe
                free_device_memory(cuda)
                results["runs"].append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if k not in ("step_profile", "host_profile")}, flush=True)
                if "step_profile" in row:
                    prof = row["step_profile"]
                    top = ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in prof["top_kernels_ms"][:8])
                    print(f"  decode step: {prof['gpu_ms']:.3f} ms GPU in {prof['kernel_launches']} launches; {top}",
                          flush=True)
                if "host_profile" in row:
                    top = ", ".join(f"{k} {ms:.3f}" for k, ms in row["host_profile"][:10])
                    print(f"  decode step host time by function (ms, profiled): {top}", flush=True)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    print(generate_markdown(results), flush=True)
    return results


def decode_step_profile(generate, new_tokens: int) -> dict:
    """GPU time of one decode step by kernel: a profiled `new_tokens`-token call less a profiled one-token call (the
    same prefill), kernel by kernel, over the `new_tokens - 1` steps between them. `generate(tokens)` runs one call."""
    full, _ = kernel_times(lambda: generate(new_tokens))
    prefill, _ = kernel_times(lambda: generate(1))
    steps = new_tokens - 1
    per_step = {}
    for key, (us, count) in full.items():
        base_us, base_count = prefill.get(key, (0.0, 0))
        if count > base_count:
            per_step[key] = (max(us - base_us, 0.0) / steps, round((count - base_count) / steps))
    return kernel_summary(per_step)


def host_step_profile(generate, new_tokens: int, top: int = 16) -> list[tuple[str, float]]:
    """Where a decode step's host time goes: Python's profiler over a `new_tokens`-token call less a one-token call
    (the same prefill), the functions with the most time of their own, in ms per step (under the profiler, which
    slows Python: shares, not times). `generate` synchronises the device at every step, so host time is time the
    GPU waits."""
    own = []
    for tokens in (new_tokens, 1):
        profiler = cProfile.Profile()
        profiler.runcall(generate, tokens)
        stats = pstats.Stats(profiler).stats
        own.append({f"{'/'.join(path.split('/')[-2:])}:{line} {name}": tottime * 1e3
                    for (path, line, name), (_, _, tottime, _, _) in stats.items()})
    full, prefill = own
    steps = new_tokens - 1
    per_step = {key: (ms - prefill.get(key, 0.0)) / steps for key, ms in full.items()}
    return [(key, round(ms, 4)) for key, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]]


def _cudagraph_skips() -> int:
    """Graphs Inductor was asked to capture as CUDA graphs and ran without (it logs why)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def decode_step_ms(ttft: list[float], full: list[float], new_tokens: int) -> tuple[float | None, str]:
    """ms per decoded token from the repeats of a 1-token and an N-token call: (median difference) / (N - 1), or
    None and why when the difference is within the calls' run-to-run spread (a long prefill next to a short decode:
    the difference would be noise, or negative)."""
    decode = statistics.median(full) - statistics.median(ttft)
    spread = max(full) - min(full) + max(ttft) - min(ttft)
    if decode <= spread:
        difference = (f"{decode:.2f} ms longer than" if decode >= 0 else f"{-decode:.2f} ms shorter than")
        return None, (f"decode not resolved: the {new_tokens}-token call is {difference} the 1-token call, within the "
                      f"repeats' spread of {spread:.2f} ms or below it; ask for more new tokens or repeats")
    return decode / max(new_tokens - 1, 1), ""


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def generate_markdown(results: dict) -> str:
    env = results["env"]
    lines = [f"# dsfuse generate benchmark: preset {results['preset']}, {results['dtype']}, "
             f"{results['new_tokens']} new tokens{', left-padded' if results['padded'] else ''}", "",
             " · ".join(f"{k} {v}" for k, v in env.items()), "",
             f"Prefill chunk {results['prefill_chunk']} for dsfuse; weights {results['weights_gib']} GiB. "
             "ms/token = (N-token call - 1-token call) / (N - 1), medians of the repeats; '-' where that "
             "difference is within the repeats' spread (see the notes). ms/step: the median (and the longest) "
             "time from one new token to the next inside the N-token calls.", "",
             "| batch | prompt | config | TTFT ms | ms/token | ms/step median (max) | tok/s | TTFT / Inductor "
             "| decode speedup vs Inductor | peak GiB beyond weights | tokens vs eager | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["batch"], r["prompt"]): r for r in results["runs"] if r["config"] == "inductor" and "ttft_ms" in r}
    for r in results["runs"]:
        ref = base.get((r["batch"], r["prompt"]))
        ttft_ratio = decode_ratio = "-"
        if ref and "ttft_ms" in r:
            ttft_ratio = f"{r['ttft_ms'] / ref['ttft_ms']:.2f}x"
            if ref.get("step_ms_median") and r.get("step_ms_median"):
                decode_ratio = f"{ref['step_ms_median'] / r['step_ms_median']:.2f}x"
            elif ref.get("ms_per_token") and r.get("ms_per_token"):
                decode_ratio = f"{ref['ms_per_token'] / r['ms_per_token']:.2f}x"
        if "tokens_equal_eager" in r:
            check = "equal" if r["tokens_equal_eager"] else f"prefix {r['matching_prefix']}/{results['new_tokens']}"
        else:
            check = "-"
        notes = r.get("error", "") or r.get("decode_unresolved", "")
        if r.get("recompiles_timed"):
            notes += f" {r['recompiles_timed']} recompiles while timed"
        if r.get("cudagraph_skips"):
            notes += f" {r['cudagraph_skips']} graphs not captured as CUDA graphs"
        if "step_gpu_idle_ms" in r:
            notes += (f" step: {r['step_profile']['gpu_ms']:.3f} ms of GPU work, "
                      f"{r['step_gpu_idle_ms']:.3f} ms waiting for the host")
        if r.get("rewritten"):
            notes += " rewritten " + ",".join(f"{k}={v}" for k, v in r["rewritten"].items())
        step = "-" if r.get("step_ms_median") is None else f"{r['step_ms_median']:.3f} ({r['step_ms_max']:.3f})"
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['config']} | {_fmt(r.get('ttft_ms'), '.2f')} | "
                     f"{_fmt(r.get('ms_per_token'), '.3f')} | {step} | {_fmt(r.get('tok_per_s'), '.1f')} | "
                     f"{ttft_ratio} | "
                     f"{decode_ratio} | {r.get('peak_extra_gib', '-')} | {check} | {notes.strip()} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--prompt", type=int, nargs="+", default=[2048, 8192], help="prompt lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes")
    parser.add_argument("--padded", action="store_true", help="left-pad the rows of a batch to different lengths")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per call (N)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="dsfuse's prefill chunk, Inductor's too on V4 (default: the recipe's)")
    parser.add_argument("--configs", default=",".join(GENERATE_CONFIGS), help=f"comma list of {GENERATE_CONFIGS}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true",
                        help="add one decode step's GPU time by kernel and host time by function (a profiled N-token "
                        "call less a 1-token one)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--markdown", default=None, help="write a Markdown table here")


def run(args, parser) -> dict:
    from dsfuse.generation import DEFAULT_PREFILL_CHUNK

    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in GENERATE_CONFIGS]
    if unknown:
        parser.error(f"unknown generate config(s) {unknown}; valid: {', '.join(GENERATE_CONFIGS)}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.chunk = args.chunk or DEFAULT_PREFILL_CHUNK
    return bench_generate(args)
