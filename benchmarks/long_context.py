"""Long sequences on CPU: the `xla` attention against the `chunked` (flash-style) one.

A small decoder-only model (`configs/models/decoder_only/tiny.gin` widened to 4 heads of 64 and a
256-token vocabulary, so that attention, not the logits, dominates memory) trained in fp32 on one
CPU device at sequence lengths 2k, 4k and 8k, through `benchmarks/accelerator.py` (each
implementation in its own process, the same batches and initial weights). Per length and
implementation: the compiled train step's memory (arguments + outputs + temporaries - aliased)
and the median step time; the ratios are `chunked` over `xla`.

    python benchmarks/long_context.py [--lengths 2048,4096,8192] [--steps 3]
    python benchmarks/long_context.py --smoke   # 256 and 512 tokens, 1 timed step (CI)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accelerator
from _record import write_record

MODEL = ["EMBED_DIM=256", "NUM_HEADS=4", "NUM_KV_HEADS=4", "HEAD_DIM=64", "VOCAB_SIZE=256"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.steps = "256,512", 1
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in [int(x) for x in args.lengths.split(",")]:
            record = accelerator.main(
                [
                    "--gin_file",
                    "models/decoder_only/tiny.gin",
                    *(a for binding in MODEL for a in ("--gin", binding)),
                    "--attention",
                    "xla,chunked",
                    "--batch",
                    "1",
                    "--length",
                    str(length),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    "1",
                    "--remat",
                    "none",
                    "--precision",
                    "float32",
                    "--no_check",
                    "--out",
                    f"{tmp}/{length}.json",
                ]
            )
            by_impl = {r["implementation"]: r for r in record["results"] if "error" not in r}
            if set(by_impl) != {"xla", "chunked"}:
                raise SystemExit(f"long_context: a run failed at length {length}: {record}")
            xla, chunked = by_impl["xla"], by_impl["chunked"]
            rows.append(
                {
                    "length": length,
                    "xla_mib": xla["compiled_bytes"] / 2**20,
                    "chunked_mib": chunked["compiled_bytes"] / 2**20,
                    "xla_ms": xla["step_ms"],
                    "chunked_ms": chunked["step_ms"],
                }
            )
    print(
        f"{'length':>7} {'xla MiB':>9} {'chunked MiB':>12} {'ratio':>6} "
        f"{'xla ms':>9} {'chunked ms':>11} {'ratio':>6}"
    )
    figures = []
    for r in rows:
        mem, time = r["chunked_mib"] / r["xla_mib"], r["chunked_ms"] / r["xla_ms"]
        print(
            f"{r['length']:>7} {r['xla_mib']:>9.1f} {r['chunked_mib']:>12.1f} {mem:>6.2f} "
            f"{r['xla_ms']:>9.1f} {r['chunked_ms']:>11.1f} {time:>6.2f}"
        )
        figures += [
            {
                "name": f"compiled memory at {r['length']}",
                "value": r["chunked_mib"],
                "unit": "MiB",
                "reference": r["xla_mib"],
                "ratio": mem,
                "goal": "< 1",
                "met": mem < 1,
            },
            {
                "name": f"step time at {r['length']}",
                "value": r["chunked_ms"],
                "unit": "ms",
                "reference": r["xla_ms"],
                "ratio": time,
                "goal": None,
                "met": None,
            },
        ]
    record = {
        "benchmark": "long_context",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
        "versions": accelerator.versions(),
        "rows": rows,
        "figures": figures,
    }
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
