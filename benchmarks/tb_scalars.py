"""The TensorBoard scalars of every run under a folder, as one CSV (run, tag, step, value), and
per run the mean of each tag over the first and the last quarter of its steps (single steps are
single contexts, too noisy to read alone).

    python benchmarks/tb_scalars.py RUNS_DIR --out scalars.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tags", nargs="+", default=["train/memory", "train/expected_memory", "train/nll", "train/kl"])
    args = parser.parse_args()
    folders = sorted({event.parent for event in args.runs.rglob("events.out.tfevents.*")})
    if not folders:
        raise SystemExit(f"no TensorBoard event files under {args.runs}")
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "tag", "step", "value"])
        for folder in folders:
            run = str(folder.relative_to(args.runs))
            events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
            events.Reload()
            quarters = []
            for tag in events.Tags()["scalars"]:
                values = [(e.step, e.value) for e in events.Scalars(tag)]
                writer.writerows([run, tag, step, value] for step, value in values)
                if tag in args.tags and len(values) >= 4:
                    q = len(values) // 4
                    first, last = (statistics.mean(v for _, v in part) for part in (values[:q], values[-q:]))
                    quarters.append(f"{tag.split('/')[-1]} {first:.3f} -> {last:.3f}")
            print(run, "|", " | ".join(quarters))


if __name__ == "__main__":
    main()
