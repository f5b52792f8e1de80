"""Model-level fuzz: compile HF presets at many lengths and batch sizes, record what dsfuse rewrote and left alone,
and compare logits against eager beside Inductor's.

For each preset, batch size (rows after the first left-padded to different lengths) and sequence length, one
prefill under `torch.no_grad()`: eager, `torch.compile(backend="inductor")` and `torch.compile(backend="dsfuse")`.
Recorded per case: dsfuse's site counts per family, its near-misses (with their reasons), the max |logits - eager|
relative to max |eager| for dsfuse and for Inductor on the rows' real (unpadded) tokens, and any error.

With `--generate N` each case is a greedy `model.generate(..., max_new_tokens=N)` instead: eager (transformers'
default cache), dsfuse's recipe (`dsfuse.generation.generate_kwargs`: chunked prefill and decode steps compiled) and,
unless --no-inductor, the same recipe with every pass off (plain Inductor). Recorded apart for the decode graphs (one
token per sequence; a one-token prompt or chunk tail looks the same) and the prefill graphs: graphs compiled, sites
per family, near-misses; and whether dsfuse's tokens are eager's, with the number of new tokens every row shares with
eager's from the first (Inductor's beside it: in bf16 a near tie of random weights can flip a token of either).

With `--reuse auto|dynamic` one compiled model per preset and batch serves every length (`auto`: torch.compile's
default, static first and dynamic from the second length; `dynamic`: `dynamic=True`), and each case records the graphs
that call compiled: a length that recompiles, or one whose graph lost a family's sites, shows in its row.

With `--fp32-reference` the same weights also run eagerly in fp32, and each of eager bf16, Inductor and dsfuse is
measured against it: a kernel that rounds less than bf16 eager is further from eager but not from the math.

With `--boundary-lengths` each preset runs at the lengths its kernels and transformers' code split on, drawn from its
config (`boundary_lengths`). `--merge A.json B.json ...` writes the cases of several runs (say one process per preset,
batch and compile mode, run side by side) as one table, under a line naming the date, commit, device and versions.

Writes `model_fuzz.json` and `model_fuzz.md` to --out (default $OUT).

    python -P benchmarks/model_fuzz_gpu.py                       # the GPU sweep (H200)
    python -P benchmarks/model_fuzz_gpu.py --generate 8 --presets glm-tiny --lengths 5 200 --batches 1 8
    python -P benchmarks/model_fuzz_gpu.py --cpu-smoke --out DIR # one tiny-preset case on CPU (< 1 min on a free CPU)
    python -P benchmarks/model_fuzz_gpu.py --presets v4-tiny --batches 3 --reuse auto --boundary-lengths
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import traceback
from pathlib import Path

import torch

GPU_PRESETS = ("tiny", "glm-tiny", "v32-real-2l", "v4-tiny")
# generate's recipe: a static cache for V3.2 and GLM, `V4DecodeCache` for V4
GENERATE_PRESETS = ("tiny", "glm-tiny", "v32-real-2l", "v4-tiny")
GPU_LENGTHS = (1, 5, 65, 200, 2049, 8192)
GPU_BATCHES = (1, 2, 8)
# the real-dims preset at batch 8 and 8192 tokens does not fit beside eager's materialised attention
SKIP = {("v32-real-2l", 8, 8192), ("v32-real-2l", 8, 2049)}


LONGEST_BOUNDARY = 4097


def boundary_lengths(config) -> list[int]:
    """Sequence lengths around every edge a preset's code splits on, up to LONGEST_BOUNDARY: one to three tokens,
    small primes, the index top-k, the sliding window, each compressor ratio and the compressed length that fills the
    top-k (ratio x top-k) each minus one, at and plus one; a block of 128 either side; 1000, 2049 and 4097."""
    points = {1, 2, 3, 7, 13, 127, 128, 129, 1000, 2049, LONGEST_BOUNDARY}
    topk = getattr(config, "index_topk", None)
    rates = list((getattr(config, "compress_rates", None) or {}).values())
    edges = [topk, getattr(config, "sliding_window", None), *rates, *(rate * topk for rate in rates if topk)]
    for edge in filter(None, edges):
        points |= {edge - 1, edge, edge + 1}
    return sorted(p for p in points if 1 <= p <= LONGEST_BOUNDARY)


def _inputs(vocab: int, batch: int, seq: int, device, seed: int = 0):
    """Token ids and a left-padding mask: row r has r * seq // (2 * batch) padded positions (row 0 none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        mask[row, : min(seq - 1, row * seq // (2 * batch))] = 0
    return ids.to(device), mask.to(device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> float:
    out, ref = out.float()[keep], ref.float()[keep]
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item() if ref.numel() else 0.0


def _recorded(case: dict, measure, reset: bool = True) -> dict:
    """`case` with the fields `measure()` returns, or the error it raised (a failing case is a finding: recorded,
    and the sweep goes on), and the seconds it took."""
    start = time.perf_counter()
    try:
        case.update(measure())
    except Exception as error:
        case["error"] = f"{type(error).__name__}: {error}"
        case["traceback"] = traceback.format_exc(limit=8)
    case["seconds"] = round(time.perf_counter() - start, 1)
    if reset:
        torch._dynamo.reset()
    return case


def _summary(rep, graphs: list) -> dict:
    """Graphs compiled, sites per family, near-misses and notes of `graphs` (some of the report's graphs)."""
    from dsfuse import PASS_NAMES

    chosen = {graph.index for graph in graphs}
    sites = [site.pass_name for site in rep.sites if site.graph in chosen]
    return dict(
        graphs=len(chosen),
        sites={name: sites.count(name) for name in PASS_NAMES if name in sites},
        near_misses=[{"pass": m.pass_name, "anchor": m.anchor, "reason": m.reason}
                     for m in rep.near_misses if m.graph in chosen],
        notes=[graph.note for graph in graphs if graph.note],
    )


def run_case(model, preset: str, batch: int, seq: int, device, with_inductor: bool = True, reuse=None,
             reference=None) -> dict:
    """One prefill each: eager, Inductor and dsfuse, each a fresh compile or, with `reuse` = (Inductor's, dsfuse's,
    mode), those compiled models; with `reference` (the model in fp32) each is also measured against it."""
    import dsfuse

    ids, mask = _inputs(model.config.vocab_size, batch, seq, device)
    keep = mask.bool()

    def measure():
        with torch.no_grad():
            eager = model(input_ids=ids, attention_mask=mask).logits
            if reuse is None:
                torch._dynamo.reset()
            inductor = None
            if with_inductor:
                compiled = reuse[0] if reuse else torch.compile(model, backend="inductor")
                inductor = compiled(input_ids=ids, attention_mask=mask).logits
                if reuse is None:
                    torch._dynamo.reset()
            if reuse is None:
                dsfuse.reset_report()
            first = len(dsfuse.report().graphs)
            compiled = reuse[1] if reuse else torch.compile(model, backend="dsfuse")
            fused = compiled(input_ids=ids, attention_mask=mask).logits
            truth = None if reference is None else reference(input_ids=ids, attention_mask=mask).logits
        found = dict(
            _summary(dsfuse.report(), dsfuse.report().graphs[first:]),
            dsfuse_err=_rel_err(fused, eager, keep),
            inductor_err=None if inductor is None else _rel_err(inductor, eager, keep),
            nan=bool(fused[keep].isnan().any()),
        )
        if truth is not None:
            found["vs_fp32"] = {name: _rel_err(out, truth, keep) for name, out in
                                (("eager", eager), ("inductor", inductor), ("dsfuse", fused)) if out is not None}
        return found

    case = {"preset": preset, "attn": model.config._attn_implementation, "batch": batch, "seq": seq}
    if reuse is not None:
        case["reuse"] = reuse[2]
    return _recorded(case, measure, reset=reuse is None)


def _recipe_generate(model, ids, mask, new_tokens: int, options=None):
    """`model.generate` through dsfuse.generation's recipe (a fresh static cache of prompt + new tokens)."""
    from dsfuse.generation import generate_kwargs

    kwargs = generate_kwargs(model, ids.shape[0], ids.shape[1] + new_tokens, options=options,
                             compile_all_devices=not ids.is_cuda)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kwargs)


def _matching_prefix(out: torch.Tensor, ref: torch.Tensor, prompt: int) -> int:
    """How many new tokens, from the first, every row of `out` shares with `ref`."""
    new, ref_new = out[:, prompt:], ref[:, prompt:]
    steps = min(new.shape[1], ref_new.shape[1])
    differs = (new[:, :steps] != ref_new[:, :steps]).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else steps


def _by_graph_kind(rep) -> dict:
    """{"prefill": ..., "decode": ...}: the graphs of each kind, their sites per family and their near-misses."""
    return {kind: _summary(rep, [graph for graph in rep.graphs if (graph.tokens == 1) == (kind == "decode")])
            for kind in ("prefill", "decode")}


def run_generate_case(model, preset: str, batch: int, seq: int, new_tokens: int, device,
                      with_inductor: bool = True) -> dict:
    """One greedy generate each: eager, dsfuse's recipe, and (with_inductor) the recipe with every pass off."""
    import dsfuse

    ids, mask = _inputs(model.config.vocab_size, batch, seq, device)

    def measure():
        with torch.no_grad():
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            inductor = None
            if with_inductor:
                torch._dynamo.reset()
                every_pass_off = {"disable": list(dsfuse.PASS_NAMES)}
                inductor = _recipe_generate(model, ids, mask, new_tokens, options=every_pass_off)
            torch._dynamo.reset()
            dsfuse.reset_report()
            fused = _recipe_generate(model, ids, mask, new_tokens)
        return dict(
            _by_graph_kind(dsfuse.report()),
            tokens_equal=fused.shape == eager.shape and bool(torch.equal(fused, eager)),
            prefix=_matching_prefix(fused, eager, seq),
            inductor_prefix=None if inductor is None else _matching_prefix(inductor, eager, seq),
        )

    case = {"preset": preset, "attn": model.config._attn_implementation, "batch": batch, "seq": seq,
            "generate": new_tokens}
    return _recorded(case, measure)


def _fmt_err(err) -> str:
    return "-" if err is None else f"{err:.2e}"


def write(out: Path, cases: list[dict]) -> None:
    """Both files after every case: a run cut short by its time limit still leaves what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_fuzz.json").write_text(json.dumps(cases, indent=1))
    (out / "model_fuzz.md").write_text(markdown(cases))


def _cell(case: dict) -> tuple:
    return case["preset"], case["batch"], case.get("reuse"), case["seq"], case.get("generate")


def _table_order(case: dict) -> tuple:
    return case["preset"], case["batch"], case.get("reuse", "fresh"), "generate" in case, case["seq"]


def _replaced_outcome(case: dict) -> str:
    if "error" in case:
        return case["error"][:120]
    misses = "; ".join(f"{m['pass']}: {m['reason'][:100]}" for m in case.get("near_misses", [])) or "none"
    return f"{_sites_text(case.get('sites') or {})}; near-misses: {misses}"


def merge(paths: list[str], out: Path, batches=(1, 2, 3), modes=("auto", "dynamic")) -> list[dict]:
    """The cases of several runs' `model_fuzz.json` files (a process's list of cases, or an earlier merge with its
    environment) as one `model_fuzz.json` / `model_fuzz.md`: a line per source environment (date, commit, device,
    versions), the table in preset, batch, compile-mode and length order, and the grid's cells no source ran (each
    preset seen x `batches` x `modes` x its `boundary_lengths`). A cell's error is listed apart when another case of
    the cell ran without one (a rerun, e.g. alone after running out of memory beside other processes), and so is a
    cell's case that a later source ran again (a rerun after a fix: the later case is the table's)."""
    from dsfuse.bench.measure import environment
    from dsfuse.models.presets import hf_config

    cases, envs = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        source = data["env"] if isinstance(data, dict) else environment()
        source = source if isinstance(source, list) else [source]
        envs += [env for env in source if env not in envs]
        for case in data["cases"] if isinstance(data, dict) else data:
            cases.append({**case, "commit": case.get("commit", source[0]["commit"])})
    # the last case of a cell that ran without an error is the table's; every other case of that cell is replaced
    latest = {_cell(c): i for i, c in enumerate(cases) if "error" not in c}
    last = set(latest.values())
    kept = [i in last or _cell(c) not in latest for i, c in enumerate(cases)]
    replaced = sorted((c for c, keep in zip(cases, kept) if not keep), key=_table_order)
    cases = sorted((c for c, keep in zip(cases, kept) if keep), key=_table_order)
    heads = sorted({f"{e['date'][:10]}, commit {e['commit']}, {e['device']}, torch {e['torch']}, triton {e['triton']}, "
                    f"transformers {e.get('transformers', '-')}" for e in envs})
    ran = {(c["preset"], c["batch"], c.get("reuse"), c["seq"]) for c in cases if "generate" not in c}
    missing = []
    for preset in sorted({c["preset"] for c in cases}):
        lengths = boundary_lengths(hf_config(preset))
        for batch in batches:
            for mode in modes:
                absent = [seq for seq in lengths if (preset, batch, mode, seq) not in ran]
                if absent:
                    missing.append(f"| {preset} | {mode} | {batch} | {' '.join(map(str, absent))} |")
    text = "\n".join(heads) + "\n\n" + markdown(cases)
    if replaced:
        text += ("\nCases of cells that ran again, by a later source or after an error (the rerun is in the table):\n\n"
                 "| preset | compile | B | S | commit | error, or the sites and near-misses it had |\n"
                 "| --- | --- | ---: | ---: | --- | --- |\n"
                 + "\n".join(f"| {c['preset']} | {c.get('reuse', 'fresh')} | {c['batch']} | {c['seq']} | {c['commit']} "
                             f"| {_replaced_outcome(c)} |" for c in replaced) + "\n")
    if missing:
        text += ("\nCells of the grid no source ran:\n\n| preset | compile | B | S |\n| --- | --- | ---: | --- |\n"
                 + "\n".join(missing) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_fuzz.json").write_text(json.dumps({"env": envs, "cases": cases, "replaced": replaced},
                                                    indent=1))
    (out / "model_fuzz.md").write_text(text)
    return cases


def markdown(cases: list[dict]) -> str:
    """The prefill cases' table and the generate cases' table, each where there are such cases."""
    prefills = [c for c in cases if "generate" not in c]
    generated = [c for c in cases if "generate" in c]
    tables = [_prefill_table(prefills)] if prefills or not generated else []
    return "\n".join(tables + ([_generate_table(generated)] if generated else []))


def _sites_text(sites: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sites.items()) or "-"


def _generate_table(cases: list[dict]) -> str:
    lines = ["| preset | attn | B | S | N | graphs prefill + decode | prefill sites | prefill near-misses "
             "| decode sites | decode near-misses | tokens = eager | prefix | inductor prefix | s |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for c in cases:
        head = f"| {c['preset']} | {c['attn']} | {c['batch']} | {c['seq']} | {c['generate']} |"
        if "error" in c:
            lines.append(f"{head} ERROR {c['error'][:80]} | | | | | | | | {c['seconds']} |")
            continue
        prefill, decode = c["prefill"], c["decode"]
        inductor = "-" if c["inductor_prefix"] is None else c["inductor_prefix"]
        lines.append(f"{head} {prefill['graphs']} + {decode['graphs']} | {_sites_text(prefill['sites'])} | "
                     f"{len(prefill['near_misses'])} | {_sites_text(decode['sites'])} | {len(decode['near_misses'])} | "
                     f"{'yes' if c['tokens_equal'] else 'no'} | {c['prefix']} | {inductor} | {c['seconds']} |")
    return "\n".join(lines) + "\n"


def _prefill_table(cases: list[dict]) -> str:
    lines = ["| preset | compile | B | S | graphs compiled | sites | near-misses | dsfuse err | inductor err "
             "| vs fp32: eager / inductor / dsfuse | s |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for c in cases:
        head = f"| {c['preset']} | {c.get('reuse', 'fresh')} | {c['batch']} | {c['seq']} |"
        if "error" in c:
            lines.append(f"{head} | ERROR {c['error'][:80]} | | | | | {c['seconds']} |")
            continue
        sites = _sites_text(c["sites"]) if c["graphs"] else "(no new graph)"
        truth = c.get("vs_fp32")
        truth = " / ".join(_fmt_err(truth.get(k)) for k in ("eager", "inductor", "dsfuse")) if truth else "-"
        lines.append(f"{head} {c['graphs']} | {sites} | {len(c['near_misses'])} | {c['dsfuse_err']:.2e} | "
                     f"{_fmt_err(c['inductor_err'])} | {truth} | {c['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="one layer of the tiny preset, B=2 at S=5, on CPU")
    parser.add_argument("--presets", nargs="*", default=None)
    parser.add_argument("--lengths", nargs="*", type=int, default=None)
    parser.add_argument("--boundary-lengths", action="store_true",
                        help="each preset at boundary_lengths(its config) instead of --lengths")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="write these runs' cases as one table to --out and exit")
    parser.add_argument("--batches", nargs="*", type=int, default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="the models' attention implementation")
    parser.add_argument("--no-inductor", action="store_true", help="compare dsfuse with eager only (faster)")
    parser.add_argument("--reuse", choices=("auto", "dynamic"), default=None,
                        help="one compiled model per preset and batch for every length (see above)")
    parser.add_argument("--fp32-reference", action="store_true", help="also measure each against fp32 eager")
    parser.add_argument("--generate", type=int, default=None, metavar="N",
                        help="each case a greedy generate of N new tokens (prompts of --lengths) instead of a prefill")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, Path(args.out))
        return 0
    # The Inductor- and the dsfuse-compiled model share the wrapped forward's code object, hence one recompile
    # count: V4's length boundaries give each backend up to five graphs, past Dynamo's default limit of 8 in all.
    # A case past the raised limit fails rather than running eagerly and matching eager exactly.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    from dsfuse.models.presets import build_hf_model

    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        presets, lengths, batches = args.presets or ["tiny"], args.lengths or [5], args.batches or [2]
        overrides = {"num_hidden_layers": 1}
    else:
        device, dtype = "cuda", torch.bfloat16
        presets = args.presets or (GENERATE_PRESETS if args.generate else GPU_PRESETS)
        lengths = args.lengths or GPU_LENGTHS
        batches = args.batches or GPU_BATCHES
        overrides = {}
    cases, out = [], Path(args.out)
    for preset in presets:
        model = build_hf_model(preset, dtype=dtype, device=device, attn_implementation=args.attn, **overrides)
        if args.generate:  # exactly N new tokens a row: padding has an id, no end-of-sequence token stops a row
            model.generation_config.pad_token_id = 0
            model.generation_config.eos_token_id = None
        reference = copy.deepcopy(model).float() if args.fp32_reference else None
        for batch in batches:
            reuse = None
            if args.reuse:
                import dsfuse

                torch._dynamo.reset()
                dsfuse.reset_report()
                dynamic = True if args.reuse == "dynamic" else None
                reuse = (torch.compile(model, backend="inductor", dynamic=dynamic),
                         torch.compile(model, backend="dsfuse", dynamic=dynamic), args.reuse)
            for seq in boundary_lengths(model.config) if args.boundary_lengths else lengths:
                if (preset, batch, seq) in SKIP and not args.cpu_smoke:
                    continue
                if args.generate:
                    case = run_generate_case(model, preset, batch, seq, args.generate, device,
                                             with_inductor=not args.no_inductor)
                else:
                    case = run_case(model, preset, batch, seq, device, with_inductor=not args.no_inductor,
                                    reuse=reuse, reference=reference)
                cases.append(case)
                write(out, cases)
                print(json.dumps({k: v for k, v in case.items() if k != "traceback"}), flush=True)
        del model, reference
        if device == "cuda":
            torch.cuda.empty_cache()
    write(out, cases)
    print(markdown(cases))
    return 1 if any("error" in c for c in cases) else 0


if __name__ == "__main__":
    raise SystemExit(main())
