"""What `python -m dsfuse.bench` hands to people: Markdown tables, a figure, and a progress bar.

Everything here reads the results dict that `bench.py` writes as JSON, so a table or figure can be made
again later from a saved run (`python -m dsfuse.bench plot RESULTS.json --out FIG.png`).
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
    if "deterministic" in row:
        notes.append(f"run twice bitwise equal: {row['deterministic']}")
    if "bitwise_equal_to_inductor" in row:
        notes.append(f"bitwise==inductor: {row['bitwise_equal_to_inductor']}")
    if row.get("rewritten"):
        notes.append("rewritten " + ", ".join(f"{k}={v}" for k, v in row["rewritten"].items() if v))
    return "; ".join(notes)


def model_markdown(results: dict) -> str:
    """The `model` table, and for `--profile` runs a second table of GPU time by stage."""
    speedups = speedups_vs_inductor(results)
    header = ["S", "config", "ms", "tok/s", "vs Inductor", "first call s", "peak extra GiB", "rel_l2 vs eager",
              "notes"]
    rows = []
    for r in results["runs"]:
        speedup = speedups.get(r["config"], {}).get(r["seq"])
        rows.append([r["seq"], r["config"], _fmt(r.get("ms"), ".3f"), _fmt(r.get("tok_per_s"), ",.0f"),
                     "-" if speedup is None else f"{speedup:.2f}x", r.get("first_call_s", "-"),
                     r.get("peak_extra_gib", "-"), _fmt(r.get("rel_l2_vs_eager"), ".2e"), _model_notes(r)])
    lines = [f"# dsfuse model benchmark: preset {results.get('preset')}, {results.get('dtype')}, "
             f"batch {results.get('batch')}", "", environment_line(results.get("env", {})), ""]
    lines += _table(header, rows)
    profiled = [r for r in results["runs"] if "profile" in r]
    if profiled:
        lines += ["", "## Time by stage", ""]
        stage_rows = []
        for r in profiled:
            prof = r["profile"]
            shares = ", ".join(f"{op} {share:.1%}" for op, share in prof.get("dsfuse_ops_share", {}).items())
            top = "<br>".join(f"{ms:.3f} ms {name}" for name, ms in prof.get("top_kernels_ms", [])[:MARKDOWN_KERNELS])
            stage_rows.append([r["seq"], r["config"], _fmt(prof.get("gpu_ms"), ".3f"), shares or "none", top])
        lines += _table(["S", "config", "GPU ms", "fused dsfuse ops (share of GPU time)",
                         f"top {MARKDOWN_KERNELS} kernels"], stage_rows)
    return "\n".join(lines) + "\n"


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
    """Speedup over Inductor against S per configuration; GPU time by stage at the largest S if profiled."""
    if "runs" not in results:
        raise ValueError("not a `model` results file (no 'runs'); `plot` reads `python -m dsfuse.bench model --json`")
    speedups = speedups_vs_inductor(results)
    if not speedups:
        raise ValueError("no configuration was timed alongside Inductor in this results file, so there is "
                         "nothing to plot (run `model` with --configs including inductor)")
    plt = _pyplot()
    breakdown = stage_breakdown(results)
    fig, axes = plt.subplots(1, 2 if breakdown else 1, figsize=(13 if breakdown else 7, 4.5), squeeze=False)
    ax = axes[0][0]
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
    ax.set_title(f"{results.get('preset', '')} prefill, {results.get('env', {}).get('device', '')}")
    ax.grid(alpha=0.3)
    ax.legend()
    if breakdown:
        seq, stages = breakdown
        ax = axes[0][1]
        configs = list(stages)
        bottoms = [0.0] * len(configs)
        for name in next(iter(stages.values())):
            heights = [stages[c][name] for c in configs]
            ax.bar(configs, heights, bottom=bottoms, label=name[:48])
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("GPU ms per call")
        ax.set_title(f"GPU time by stage, S={seq}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
