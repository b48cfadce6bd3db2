"""Kernel microbenchmarks: HBM traffic, grid steps, MXU work, VMEM and modelled time per TPU
generation, for our kernels and the JAX anchors on the same shapes.

    python benchmarks/run.py                 # named (real-model) shapes + small shapes; writes
                                             # benchmarks/results/{results.md,results.json,*.png}
    python benchmarks/run.py --small         # recompute only the small-shape section (fast)
    python benchmarks/run.py --kernel flash_attention --shape flux_dev_joint4608
                                             # only that shape's named rows, in place
    python benchmarks/run.py --device tpu    # on a TPU VM: also measure times on the chip
    python benchmarks/run.py --no-write      # print the Markdown table only

Small shapes run in TPU interpret mode under the traffic counter (torch-ext/tpu_interpreter.py):
the bytes and grid steps in that section are counted, and each row records whether the closed form
(our kernels' `tiling.estimate_cost`, the anchors' schedules in benchmarks/anchors.py) gives
exactly the same numbers. Named shapes are too large to interpret on CPU: their bytes and steps
come from those closed forms, checked on the small shapes. VMEM comes from a deviceless Mosaic
compile for v5e, v6e and TPU7x (the scoped VMEM the compiled kernel reserves), when libtpu is
installed (`.libtpu`, see tests/tpu_compile.py).

The work is split by job: registry.py (which kernels, implementations and generations),
rows.py (computing a row: closed forms, interpret counting, compile, schedule),
device_timing.py (--device tpu) and report.py (results.md and plots from the results alone;
`python benchmarks/report.py` regenerates them from results.json). This file is the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import report
import rows
from registry import KINDS
from tpu_generations import TESTED_GENERATIONS

RESULTS = report.RESULTS


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="recompute only the small-shape section (keeps the named section)",
    )
    parser.add_argument("--kernel", action="append", choices=KINDS, help="default: all")
    parser.add_argument(
        "--shape",
        action="append",
        help="only these named shapes of the kernels (their rows replaced where they stand; the "
        "small section is kept)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "tpu"),
        default="cpu",
        help="tpu: also time the named rows on the attached TPU",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip deviceless compiles")
    parser.add_argument(
        "--ours-generations",
        nargs="+",
        choices=TESTED_GENERATIONS,
        help="compile (and read the schedule of) our kernels only for these "
        "generations; the others' compile columns say n/a",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="only recompute the named rows' scheduled times from the schedule "
        "cache (no compile, no interpret run) and rewrite the outputs",
    )
    parser.add_argument(
        "--old-rows",
        default=None,
        help="with --retime: a results.json whose anchors' compile results "
        "fill rows that have none",
    )
    parser.add_argument(
        "--no-schedule",
        action="store_true",
        help="skip the compiled-schedule reading (LLO dumps) of the named rows",
    )
    parser.add_argument(
        "--cache-only",
        action="store_true",
        help="compile nothing: named rows take their compiled schedules from the schedule cache "
        "(n/a where it has none)",
    )
    parser.add_argument("--no-write", action="store_true", help="print Markdown, write nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "tpu":
        os.environ.pop("JAX_PLATFORMS", None)
    kinds = tuple(args.kernel or KINDS)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["meta"] = rows.meta()
    t0 = time.time()
    if args.retime:
        rows.retime(
            results["named"],
            log,
            args.old_rows and json.loads(Path(args.old_rows).read_text())["named"]["rows"],
        )
    elif args.device == "tpu":
        # On a TPU VM: the small (interpreted) section stays as committed, the deviceless
        # compiles are skipped (the chip itself runs the kernels), the named rows gain times.
        import device_timing

        results["named"] = rows.merge_section(
            results.get("named"), rows.run_section(False, kinds, log, False), kinds
        )
        device_timing.measure_on_device(results["named"], kinds, log)
    else:
        if not args.shape:
            results["small"] = rows.merge_section(
                results.get("small"), rows.run_section(True, kinds, log, False), kinds
            )
        if not args.small:
            results["named"] = rows.merge_section(
                results.get("named"),
                rows.run_section(
                    False,
                    kinds,
                    log,
                    not args.no_compile,
                    not args.no_compile and not args.no_schedule,
                    (results.get("named") or {}).get("rows"),
                    args.ours_generations,
                    args.cache_only,
                    args.shape,
                ),
                kinds,
                args.shape,
            )
    log(f"done in {time.time() - t0:.0f}s")
    if args.device != "tpu" and "named" in results:
        import device_timing

        device_timing.apply_measured(results)  # the chip's times (results/device/) stay on
    md = report.markdown(results)
    if args.no_write:
        sys.stdout.write(md)  # exactly what results.md would hold
        return results
    written = report.write_outputs(results, args.out, md)
    log(f"wrote {written[0]}, {written[1]}, {', '.join(p.name for p in written[2:])}")
    bad = [
        f"{r['kernel']}/{r['shape']}/{r['impl']}"
        for r in results.get("small", {}).get("rows", [])
        if r.get("closed_form_matches") is False
    ]
    if bad:  # a make target must fail when a closed form no longer matches the interpreter
        log(f"closed form != counted for: {', '.join(bad)}")
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
