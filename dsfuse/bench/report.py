"""What `python -m dsfuse.bench` hands to people: Markdown tables, a figure, and a progress bar.

Everything here reads the results dict that `dsfuse.bench.model` and `dsfuse.bench.families` write as JSON, so a
table or figure can be made again later from a saved run (`python -m dsfuse.bench plot RESULTS.json --out FIG.png`).
matplotlib and tqdm stay optional: the figure asks for matplotlib by name, the bar is silent without tqdm.
"""

from __future__ import annotations

import sys

PLOT_KERNELS = 6  # named segments in the "GPU time by stage" bars; the rest is summed into "other"
MARKDOWN_KERNELS = 5  # kernels listed per configuration in the Markdown "time by stage" table


class _SilentProgress:
    """Stands in for a tqdm bar when there is no terminal or no tqdm: same calls, no output."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str):
    """A tqdm bar on stderr when stderr is a terminal and tqdm is installed; otherwise nothing is printed."""
    if not sys.stderr.isatty():
        return _SilentProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _SilentProgress()
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def environment_line(env: dict) -> str:
    keys = ("date", "commit", "device", "torch", "triton", "transformers")
    return " · ".join(f"{key} {env[key]}" for key in keys if key in env)


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def speedups_vs_inductor(results: dict) -> dict[str, dict[int, float]]:
    """config -> {S: Inductor ms / config ms}, for sequence lengths where both were timed."""
    inductor = {r["seq"]: r["ms"] for r in results["runs"] if r["config"] == "inductor" and r.get("ms")}
    speedups: dict[str, dict[int, float]] = {}
    for r in results["runs"]:
        if r.get("ms") and r["seq"] in inductor:
            speedups.setdefault(r["config"], {})[r["seq"]] = inductor[r["seq"]] / r["ms"]
    return speedups


def _model_notes(row: dict) -> str:
    notes = [row["error"]] if "error" in row else []
    if row.get("logits") == "last":
        notes.append("last position's logits only (logits_to_keep=1)")
    if "deterministic" in row:
        notes.append(f"run twice bitwise equal: {row['deterministic']}")
    if "bitwise_equal_to_inductor" in row:
        notes.append(f"bitwise==inductor: {row['bitwise_equal_to_inductor']}")
    if row.get("rewritten"):
        notes.append("rewritten " + ", ".join(f"{k}={v}" for k, v in row["rewritten"].items() if v))
    if row.get("near_misses"):
        notes.append("near-misses: " + " | ".join(row["near_misses"]))
    return "; ".join(notes)


def _stage_table(rows: list[dict], key_header: list[str], keys) -> list[str]:
    """GPU time of one call per row: total, each fused dsfuse op's share, the most expensive kernels."""
    stage_rows = []
    for r in rows:
        prof = r["profile"]
        shares = ", ".join(f"{op} {share:.1%}" for op, share in prof.get("dsfuse_ops_share", {}).items())
        top = "<br>".join(f"{ms:.3f} ms {name}" for name, ms in prof.get("top_kernels_ms", [])[:MARKDOWN_KERNELS])
        stage_rows.append([*keys(r), _fmt(prof.get("gpu_ms"), ".3f"), shares or "none", top])
    return _table([*key_header, "GPU ms", "fused dsfuse ops (share of GPU time)", f"top {MARKDOWN_KERNELS} kernels"],
                  stage_rows)


def _prefill_tables(results: dict) -> list[str]:
    speedups = speedups_vs_inductor(results)
    header = ["S", "config", "ms", "tok/s", "vs Inductor", "first call s", "of it dsfuse's passes s", "peak extra GiB",
              "rel_l2 vs eager", "notes"]
    rows = []
    for r in results["runs"]:
        speedup = speedups.get(r["config"], {}).get(r["seq"])
        rows.append([r["seq"], r["config"], _fmt(r.get("ms"), ".3f"), _fmt(r.get("tok_per_s"), ",.0f"),
                     "-" if speedup is None else f"{speedup:.2f}x", r.get("first_call_s", "-"),
                     r.get("dsfuse_pass_s", "-"), r.get("peak_extra_gib", "-"), _fmt(r.get("rel_l2_vs_eager"), ".2e"),
                     _model_notes(r)])
    lines = _table(header, rows)
    profiled = [r for r in results["runs"] if "profile" in r]
    if profiled:
        lines += ["", "## Time by stage", ""]
        lines += _stage_table(profiled, ["S", "config"], lambda r: [r["seq"], r["config"]])
    return lines


def decode_speedups_vs_inductor(results: dict) -> dict[str, dict[tuple[int, int], float]]:
    """config -> {(batch, context): Inductor ms / config ms} over the decode rows timed alongside Inductor."""
    inductor = {(r["batch"], r["context"]): r["ms"] for r in results.get("decode", [])
                if r["config"] == "inductor" and r.get("ms")}
    speedups: dict[str, dict[tuple[int, int], float]] = {}
    for r in results.get("decode", []):
        key = (r["batch"], r["context"])
        if r.get("ms") and key in inductor:
            speedups.setdefault(r["config"], {})[key] = inductor[key] / r["ms"]
    return speedups


def decode_notes(row: dict, growing_steps) -> str:
    """Prefill fallback, errors, recompiles (a recompile per appended step shows here), sites rewritten."""
    notes = [row[key] for key in ("prefill_error", "error") if key in row]
    if row.get("recompiles_growing"):
        notes.append(f"recompiled {row['recompiles_growing']}x in {growing_steps} appended steps")
    if row.get("recompiles_timed"):
        notes.append(f"recompiled {row['recompiles_timed']}x while timed")
    if row.get("rewritten"):
        notes.append("rewritten " + ", ".join(f"{k}={v}" for k, v in row["rewritten"].items() if v))
    return "; ".join(notes)


def _decode_tables(results: dict) -> list[str]:
    speedups = decode_speedups_vs_inductor(results)
    steps = results.get("growing_steps", "-")
    explanation = (f"One new token per sequence at position T; the cache is put back to T tokens before every timed "
                   f"step (`--prefill-cache {results.get('prefill_cache', 'same')}`). ms is per decode step, tok/s = "
                   f"batch / step time. Recompiles are the Dynamo graphs compiled over {steps} steps that really "
                   f"append to the cache (0: one graph serves every length). Cache `static`: HF's StaticCache, "
                   f"filled from dsfuse's prefill, for the CUDA-graph configurations.")
    lines = ["## Decode with a KV cache", "", explanation, ""]
    rows = []
    for r in results.get("decode", []):
        speedup = speedups.get(r["config"], {}).get((r["batch"], r["context"]))
        rows.append([r["batch"], r["context"], r["config"], r.get("cache", "dynamic"), r.get("prefill_by", "-"), _fmt(r.get("ms"), ".3f"),
                     _fmt(r.get("tok_per_s"), ",.1f"), "-" if speedup is None else f"{speedup:.2f}x",
                     r.get("first_call_s", "-"), r.get("peak_extra_gib", "-"), r.get("recompiles_growing", "-"),
                     _fmt(r.get("rel_l2_vs_eager"), ".2e"), decode_notes(r, steps)])
    lines += _table(["batch", "T", "config", "cache", "prefill by", "ms/step", "tok/s", "vs Inductor", "first call s",
                     "peak extra GiB", "recompiles", "rel_l2 vs eager", "notes"], rows)
    profiled = [r for r in results.get("decode", []) if "profile" in r]
    if profiled:
        lines += ["", "## Decode time by stage", ""]
        lines += _stage_table(profiled, ["batch", "T", "config"], lambda r: [r["batch"], r["context"], r["config"]])
    return lines


def model_markdown(results: dict) -> str:
    """The `model` prefill table and/or the decode table, each with GPU time by stage for `--profile` runs."""
    title = (f"batch {results.get('batch')}" if results["runs"] or "decode" not in results
             else f"decode, batch {', '.join(map(str, results.get('decode_batches', [])))}")
    lines = [f"# dsfuse model benchmark: preset {results.get('preset')}, {results.get('dtype')}, {title}", "",
             environment_line(results.get("env", {})), ""]
    if results["runs"] or "decode" not in results:
        lines += _prefill_tables(results)
    if "decode" in results:
        lines += ["", *_decode_tables(results)] if results["runs"] else _decode_tables(results)
    return "\n".join(lines) + "\n"


def ablation_summary(results: dict) -> list[dict]:
    """Per sequence length and pass: the pass alone and all passes but it, against Inductor and all passes on.

    `all_vs_without` = (all but the pass) ms / (all on) ms: how much slower dsfuse gets without the pass.
    """
    ms = {(r["seq"], r["config"]): r.get("ms") for r in results["runs"]}
    sites = {r["seq"]: r.get("rewritten", {}) for r in results["runs"] if r["config"] == "dsfuse"}
    passes = results.get("passes") or sorted({r["config"].split(":", 1)[1] for r in results["runs"]
                                              if r["config"].startswith(("only:", "no:"))})

    def ratio(numerator, denominator):
        return numerator / denominator if numerator and denominator else None

    summary = []
    for seq in sorted({r["seq"] for r in results["runs"]}):
        inductor, all_on = ms.get((seq, "inductor")), ms.get((seq, "dsfuse"))
        for name in passes:
            alone, without = ms.get((seq, f"only:{name}")), ms.get((seq, f"no:{name}"))
            summary.append({"seq": seq, "pass": name, "sites": sites.get(seq, {}).get(name),
                            "alone_ms": alone, "alone_vs_inductor": ratio(inductor, alone),
                            "without_ms": without, "without_vs_inductor": ratio(inductor, without),
                            "all_vs_without": ratio(without, all_on)})
    return summary


def ablation_markdown(results: dict) -> str:
    """All configurations, the per-pass contribution table, and GPU time by stage."""
    explanation = ("alone: only this pass on; without: every pass but this one. `all on / without` > 1 means dsfuse "
                   "is that much faster with the pass than without it.")
    lines = [f"# dsfuse ablation: preset {results.get('preset')}, {results.get('dtype')}, batch {results.get('batch')}",
             "", environment_line(results.get("env", {})), "", "## Per-pass contribution", "", explanation, ""]
    all_on = {r["seq"]: r.get("ms") for r in results["runs"] if r["config"] == "dsfuse"}
    inductor = {r["seq"]: r.get("ms") for r in results["runs"] if r["config"] == "inductor"}
    rows = [[r["seq"], r["pass"], "-" if r["sites"] is None else r["sites"], _fmt(r["alone_ms"], ".3f"),
             _ratio(r["alone_vs_inductor"]), _fmt(r["without_ms"], ".3f"), _ratio(r["without_vs_inductor"]),
             _ratio(r["all_vs_without"])] for r in results.get("ablation") or ablation_summary(results)]
    lines += _table(["S", "pass", "sites (all on)", "alone ms", "alone vs Inductor", "without ms",
                     "without vs Inductor", "all on / without"], rows)
    lines += ["", "All passes on: " + ", ".join(
        f"S={seq} {_fmt(ms, '.3f')} ms ({_ratio(inductor[seq] / ms if ms and inductor.get(seq) else None)} vs "
        f"Inductor {_fmt(inductor.get(seq), '.3f')} ms)" for seq, ms in all_on.items()), "",
              "## All configurations", ""]
    lines += _prefill_tables(results)
    return "\n".join(lines) + "\n"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def families_markdown(results: dict) -> str:
    """The `families` table: time, TFLOP/s, share of the measured matmul peak, ratio vs Inductor, check."""
    inductor = {r["family"]: r["ms"] for r in results["rows"] if r["config"] == "inductor" and r.get("ms")}
    rows = []
    for r in results["rows"]:
        ms = r.get("ms")
        if "error" in r:
            check = r["error"]
        elif "agreement" in r:
            check = f"agree {r['agreement']:.4f}"
        else:
            check = f"rel_l2 {_fmt(r.get('rel_l2'), '.2e')}"
        if "rewritten" in r:
            check += f", rewritten {r['rewritten']}"
        ratio = f"{inductor[r['family']] / ms:.2f}x" if ms and r["family"] in inductor else "-"
        rows.append([r["family"], r["shape"], r["config"], _fmt(ms, ".3f"), _fmt(r.get("tflops"), ".1f"),
                     _fmt(r.get("pct_peak"), ".1f"), ratio, check])
    peak = results.get("bf16_matmul_tflops")
    lines = [f"# dsfuse families benchmark: size {results.get('size')}, {results.get('dtype')}, "
             f"bf16 matmul peak {_fmt(peak, '.0f')} TFLOP/s", "", environment_line(results.get("env", {})), ""]
    lines += _table(["family", "shape", "config", "ms", "TFLOP/s", "% peak", "vs Inductor", "check"], rows)
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ModuleNotFoundError("`dsfuse.bench plot` needs matplotlib: pip install matplotlib "
                                  "(or pip install 'dsfuse[bench]')", name="matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stage_breakdown(results: dict) -> tuple[int, dict[str, dict[str, float]]] | None:
    """At the largest profiled S: config -> {kernel: ms}, the most expensive kernels overall plus "other"."""
    profiled = [r for r in results["runs"] if "profile" in r]
    if not profiled:
        return None
    seq = max(r["seq"] for r in profiled)
    rows = [r for r in profiled if r["seq"] == seq]
    totals: dict[str, float] = {}
    for r in rows:
        for name, ms in r["profile"]["top_kernels_ms"]:
            totals[name] = totals.get(name, 0.0) + ms
    named = sorted(totals, key=lambda name: -totals[name])[:PLOT_KERNELS]
    stages = {}
    for r in rows:
        kernels = dict((name, ms) for name, ms in r["profile"]["top_kernels_ms"])
        stage = {name: kernels.get(name, 0.0) for name in named}
        stage["other"] = max(r["profile"]["gpu_ms"] - sum(stage.values()), 0.0)
        stages[r["config"]] = stage
    return seq, stages


def plot_model(results: dict, out: str) -> None:
    """One panel per kind of result present: prefill speedup over Inductor against S (for `ablate`: per
    configuration), GPU time by stage at the largest profiled S, decode tokens/s per batch and context."""
    if "runs" not in results:
        raise ValueError("not a `model` results file (no 'runs'); `plot` reads `python -m dsfuse.bench model --json`"
                         " or `ablate --json`")
    speedups = speedups_vs_inductor(results)
    breakdown = stage_breakdown(results)
    decode = [r for r in results.get("decode", []) if r.get("ms")]
    first = _draw_ablation if results.get("kind") == "ablate" else _draw_speedups
    candidates = ((first, bool(speedups)), (_draw_stages, bool(breakdown)), (_draw_decode, bool(decode)))
    panels = [draw for draw, present in candidates if present]
    if not panels:
        raise ValueError("no configuration was timed alongside Inductor and no decode step was timed in this results "
                         "file, so there is nothing to plot (run `model` with --configs including inductor)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, draw in zip(axes[0], panels):
        draw(ax, results)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _device(results: dict) -> str:
    return results.get("env", {}).get("device", "")


def _draw_speedups(ax, results: dict) -> None:
    speedups = speedups_vs_inductor(results)
    for config, by_seq in speedups.items():
        seqs = sorted(by_seq)
        ax.plot(seqs, [by_seq[s] for s in seqs], marker="o", label=config,
                linestyle="--" if config == "inductor" else "-")
    seqs = sorted({s for by_seq in speedups.values() for s in by_seq})
    if len(seqs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.minorticks_off()
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("speedup over Inductor (x)")
    ax.set_title(f"{results.get('preset', '')} prefill, {_device(results)}")
    ax.grid(alpha=0.3)
    ax.legend()


def _draw_ablation(ax, results: dict) -> None:
    """Speedup over Inductor of every ablation configuration at the largest S."""
    speedups = speedups_vs_inductor(results)
    seq = max(s for by_seq in speedups.values() for s in by_seq)
    configs = [r["config"] for r in results["runs"] if r["seq"] == seq]
    values = [speedups.get(config, {}).get(seq, 0.0) for config in configs]
    colors = {"eager": "lightgray", "inductor": "tab:gray", "dsfuse": "tab:blue", "no": "tab:orange",
              "only": "tab:green"}
    ax.barh(configs, values, color=[colors.get(c.split(":")[0], "tab:purple") for c in configs])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over Inductor (x); 0 = not timed")
    ax.set_title(f"{results.get('preset', '')} ablation, S={seq}, {_device(results)}")
    ax.grid(alpha=0.3, axis="x")


def _draw_stages(ax, results: dict) -> None:
    seq, stages = stage_breakdown(results)
    configs = list(stages)
    bottoms = [0.0] * len(configs)
    for name in next(iter(stages.values())):
        heights = [stages[c][name] for c in configs]
        ax.bar(configs, heights, bottom=bottoms, label=name.lstrip("_")[:48])  # matplotlib hides "_" labels
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("GPU ms per call")
    ax.set_title(f"GPU time by stage, S={seq}")
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_decode(ax, results: dict) -> None:
    """Decode tokens/s, one group of bars per (batch, context); an untimed configuration is marked."""
    rows = results["decode"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    tok_per_s = {(r["batch"], r["context"], r["config"]): r.get("tok_per_s") for r in rows if r.get("ms")}
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(shapes))]
        values = [tok_per_s.get((*shape, config)) for shape in shapes]
        ax.bar(xs, [v or 0.0 for v in values], width, label=config)
        for x, value in zip(xs, values):
            if value is None and any(r["config"] == config for r in rows):
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    timed = [v for v in tok_per_s.values() if v]
    if timed and max(timed) / min(timed) > 20:
        ax.set_yscale("log")
    ax.set_xticks(range(len(shapes)), [f"B{b} T{t}" for b, t in shapes])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{results.get('preset', '')} decode with KV cache, {_device(results)}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
