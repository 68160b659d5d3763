"""``python -m tests.fuzz --minutes N [--seed S] [--target NAME ...] [--out DIR]``: fuzz the readers and
print, per target, the cases run and how they ended (see :mod:`tests.fuzz`).  Exit status 1 when a case
ended in a bug (untyped exception, crash, timeout, memory), 0 otherwise."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.runner import BUGS, OUTCOMES, run_case
from tests.fuzz.targets import TARGETS, preload


def _save(out: Path | None, target, label: str, data: bytes | None, path: str, outcome: str, detail: str) -> None:
    if out is None:
        return
    folder = out / target.name
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / label
    if data is not None:
        stem.with_suffix(".mdb" if target.folder else ".bin").write_bytes(data)
    stem.with_suffix(".txt").write_text(f"{outcome}: {detail}\ncase: {label} ({path})\n")


def fuzz(target, seconds: float | None, cases: int | None, seed: int, timeout: float, memory_bytes: int,
         out: Path | None = None, log=None) -> dict:
    """Run ``target``'s special cases, its seeds, then mutations until ``seconds`` pass or ``cases`` ran;
    ``{"counts": {outcome: n}, "bugs": [(label, outcome, detail)]}``."""
    rng = random.Random(f"{seed}:{target.name}")
    counts = dict.fromkeys(OUTCOMES, 0)
    bugs = []
    work = Path(tempfile.mkdtemp(prefix=f"fuzz-{target.name}-"))

    def record(label, data, path, outcome, detail):
        counts[outcome] += 1
        if outcome in BUGS:
            bugs.append((label, outcome, detail))
            _save(out, target, label, data, path, outcome, detail)
            if log:
                print(f"  {target.name} {label}: {outcome}: {detail[:300]}", file=log)

    try:
        for label, make, path in target.specials(work):
            shutil.rmtree(work / "special", ignore_errors=True)
            (work / "special").mkdir()
            make()
            record(f"special-{label}", None, path, *run_case(target.read, (path,), timeout, memory_bytes))
        for i, data in enumerate(target.seeds):
            path = target.write(data, work, f"seed{i}")
            outcome, detail = run_case(target.read, (path,), timeout, memory_bytes)
            record(f"seed-{i}", data, path, "untyped" if outcome == "typed" else outcome,
                   f"a valid seed was refused: {detail}" if outcome == "typed" else detail)
        start, n = time.monotonic(), 0
        while (cases is None or n < cases) and (seconds is None or time.monotonic() - start < seconds):
            data = target.mutate(rng)
            case_dir = work / "case"
            shutil.rmtree(case_dir, ignore_errors=True)
            case_dir.mkdir()
            path = target.write(data, case_dir, f"case{n}")
            record(f"case-{seed}-{n}", data, path, *run_case(target.read, (path,), timeout, memory_bytes))
            n += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"counts": counts, "bugs": bugs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="total time, split evenly among the targets")
    parser.add_argument("--cases", type=int, help="mutated cases per target instead of a time budget")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mutations (default 0)")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="a target to fuzz (repeatable; default all)")
    parser.add_argument("--out", type=Path, help="folder for the failing inputs (default: not kept)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case (default 10)")
    parser.add_argument("--memory-mb", type=int, default=2048,
                        help="address space a case may add to its parent's (RLIMIT_AS; default 2048)")
    args = parser.parse_args(argv)
    names = args.target or list(TARGETS)
    preload()
    seconds = None if args.cases is not None else args.minutes * 60 / len(names)
    rows = []
    for name in names:
        began = time.monotonic()
        result = fuzz(TARGETS[name], seconds, args.cases, args.seed, args.timeout, args.memory_mb << 20, args.out,
                      log=sys.stdout)
        rows.append((name, result["counts"], time.monotonic() - began))
        print(f"{name}: done in {rows[-1][2]:.0f} s", flush=True)
    header = f"{'target':<18} {'cases':>6} {'ok':>6} {'typed':>6} {'bugs':>5}  " + " ".join(f"{b:>8}" for b in BUGS)
    print("\n" + header + "\n" + "-" * len(header))
    total_bugs = 0
    for name, counts, _ in rows:
        bugs = sum(counts[b] for b in BUGS)
        total_bugs += bugs
        print(f"{name:<18} {sum(counts.values()):>6} {counts['ok']:>6} {counts['typed']:>6} {bugs:>5}  "
              + " ".join(f"{counts[b]:>8}" for b in BUGS))
    if args.out and total_bugs:
        print(f"\nfailing inputs in {args.out}")
    return 1 if total_bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
