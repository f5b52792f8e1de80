"""The op fuzz suite (tests/fuzz) under the `gpu` hypothesis profile, one pytest process per test file, each under
its own time limit: a slow file cannot take the others' time, and a session cut short still leaves the table of the
files that finished.

Each file's limit is --startup seconds (torch, triton and CUDA starting) plus --per-test seconds for each of its tests.
--jobs files run at once: an example's time is mostly Triton compiling kernels for a new shape, on the host's cores.
Writes `op_fuzz.md` and `op_fuzz.json` (file, tests, examples run, passed, failed, seconds, status) to --out (default
$OUT) after every file, and each file's pytest output to `op_fuzz_logs/` there (a failing example with its blob).

    python -P benchmarks/op_fuzz_gpu.py --out $OUT                                  # the whole suite (H200)
    python -P benchmarks/op_fuzz_gpu.py --files test_fuzz_sparse_attention.py --per-test 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUZZ_DIR = REPO / "tests" / "fuzz"
PYTEST = [sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider"]


def tests_per_file(files: list[Path]) -> dict[str, int]:
    """{file relative to the repo: number of tests pytest collects from it}."""
    listing = subprocess.run([*PYTEST, "--collect-only", "-q", *map(str, files)], cwd=REPO, capture_output=True,
                             text=True).stdout
    counts = {str(f.relative_to(REPO)): 0 for f in files}
    for line in listing.splitlines():
        if "::" in line and line.split("::")[0] in counts:
            counts[line.split("::")[0]] += 1
    return counts


def summarise(output: str) -> dict:
    """Tests passed / failed from pytest -v's per-test lines (there even when the run was killed), examples run from
    hypothesis' statistics (printed at the end of the run only)."""
    outcomes = re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", output, re.MULTILINE)
    examples = re.findall(r"(\d+) passing examples, (\d+) failing examples", output)
    return {"passed": outcomes.count("PASSED"), "failed": outcomes.count("FAILED") + outcomes.count("ERROR"),
            "examples": sum(int(p) + int(f) for p, f in examples) if "Hypothesis Statistics" in output else None}


def run_file(name: str, tests: int, limit: float, profile: str, logs: Path) -> dict:
    """One pytest process over one file, killed with the processes it started when it runs past `limit` seconds."""
    env = {**os.environ, "DSFUSE_FUZZ_PROFILE": profile}
    start = time.perf_counter()
    proc = subprocess.Popen([*PYTEST, "-v", "--hypothesis-show-statistics", name], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    killed = False
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        killed = True
    seconds = round(time.perf_counter() - start, 1)
    (logs / f"{Path(name).stem}.txt").write_text(output)
    summary = summarise(output)
    # pytest's closing "=== ... in 12.3s ===" line: every test ran (a kill while the process exits leaves it)
    finished = re.search(r"^=+ .* in [\d.]+s", output, re.MULTILINE) is not None
    if not finished:
        status = f"timed out after {limit:.0f} s" if killed else f"pytest exit {proc.returncode}"
    elif not killed and proc.returncode not in (0, 1):
        status = f"pytest exit {proc.returncode}"
    else:
        status = "failed" if summary["failed"] else "passed"
    return {"file": name, "tests": tests, **summary, "seconds": seconds, "status": status}


def markdown(rows: list[dict], profile: str) -> str:
    lines = [f"op fuzz, hypothesis profile `{profile}`", "",
             "| file | tests | examples run | passed | failed | s | status |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        examples = "-" if r["examples"] is None else r["examples"]
        lines.append(f"| {r['file']} | {r['tests']} | {examples} | {r['passed']} | {r['failed']} | {r['seconds']} | "
                     f"{r['status']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", default=None, help="file names in tests/fuzz (default: all test_*.py)")
    parser.add_argument("--profile", default="gpu", help="hypothesis profile (tests/fuzz/conftest.py)")
    parser.add_argument("--per-test", type=float, default=30.0, help="seconds each test of a file adds to its limit")
    parser.add_argument("--startup", type=float, default=30.0, help="seconds each file's limit adds for starting")
    parser.add_argument("--jobs", type=int, default=1, help="files run at once")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    files = [FUZZ_DIR / f for f in args.files] if args.files else sorted(FUZZ_DIR.glob("test_*.py"))
    out = Path(args.out)
    logs = out / "op_fuzz_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows, lock = [], threading.Lock()

    def one(item):
        name, tests = item
        row = run_file(name, tests, args.startup + args.per_test * tests, args.profile, logs)
        with lock:  # the files so far, after every file
            rows.append(row)
            ordered = sorted(rows, key=lambda r: r["file"])
            (out / "op_fuzz.json").write_text(json.dumps({"profile": args.profile, "files": ordered}, indent=1))
            (out / "op_fuzz.md").write_text(markdown(ordered, args.profile))
            print(json.dumps(row), flush=True)

    by_size = sorted(tests_per_file(files).items(), key=lambda item: -item[1])  # the longest files start first
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, by_size))
    print(markdown(sorted(rows, key=lambda r: r["file"]), args.profile))
    return 0 if all(r["status"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
