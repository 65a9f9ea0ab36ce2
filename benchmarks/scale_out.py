"""Scale-out throughput (issue 20): collection windows/s, fit samples/s and fine-tuning rollouts/s
on N devices against 1, measured in the same run, as results.json and table.md under --out.

    python benchmarks/scale_out.py --model gemma3-270m --window_tokens 16384 --devices 2 --out results/scale-out

A thin driver over the library: `atskv collect` (`atskv.cli.predictor.collect`, N processes through
`atskv.predictor.launch`), `atskv fit` (`fit_main`, Lightning DDP) on the collected shards, and
`atskv finetune` (`finetune_main`) from the 1-device fit's checkpoint. With fewer than N GPUs
(or none) it runs N=1 only and says so; `--accelerator cpu` runs N CPU processes (gloo) sharing
the cores, which checks the script at toy sizes but says nothing about GPU scaling.

Rates are steady-state, so start-up (spawning, loading the model) is left out and reported apart:
collection from the shard files' completion times after every process has finished its first
window; fit and fine-tuning from the wall times of the per-step TensorBoard scalars. N>1 runs
Lightning with `ddp_spawn` (plain `ddp` would relaunch this script). The N-process collection is
also compared with the 1-process one (same manifest, bit-identical shards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from atskv.cli.predictor import collect
from atskv.eval.report import write_report
from atskv.predictor.launch import resolve_accelerator
from atskv.predictor.training import fit_main
from atskv.rl.training import finetune_main


def collect_rate(folder: Path, n: int) -> float:
    """Windows/s once all `n` processes have finished a window (shard i is window i, dealt round robin)."""
    shards = json.loads((folder / "manifest.json").read_text())["shards"]
    done = sorted((folder / s["file"]).stat().st_mtime for s in shards)
    first = max((folder / s["file"]).stat().st_mtime for s in shards[:n])
    later = [t for t in done if t > first]
    return len(later) / (done[-1] - first) if later else float("nan")


def step_rate(log_dir: Path, tag: str) -> tuple[float, int]:
    """(steps/s between the first and the last logged `tag`, steps logged)."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    points = events.Scalars(tag)
    if len(points) < 2:
        return float("nan"), len(points)
    return (points[-1].step - points[0].step) / (points[-1].wall_time - points[0].wall_time), len(points)


def digest(folder: Path) -> str:
    """A hash of the manifest and every shard's bytes: equal for equal collections."""
    h = hashlib.sha256((folder / "manifest.json").read_bytes())
    for shard in json.loads((folder / "manifest.json").read_text())["shards"]:
        h.update((folder / shard["file"]).read_bytes())
    return h.hexdigest()[:16]


def lightning_args(accelerator: str, n: int, root: Path) -> list[str]:
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
              "init_args": {"save_dir": str(root), "name": "run"}}
    return [
        "--trainer.accelerator", "gpu" if accelerator == "cuda" else "cpu", "--trainer.devices", str(n),
        "--trainer.strategy", "ddp_spawn" if n > 1 else "auto", "--trainer.log_every_n_steps", "1",
        "--trainer.default_root_dir", str(root), "--trainer.logger", yaml.safe_dump(logger, default_flow_style=True),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="austen")
    p.add_argument("--devices", type=int, default=2, help="N, compared with 1")
    p.add_argument("--accelerator", default="auto", help="cuda, cpu or auto")
    p.add_argument("--windows", type=int, default=16, help="collection windows (a multiple of N keeps ranks even)")
    p.add_argument("--window_tokens", type=int, default=2048)
    p.add_argument("--future_queries", type=int, default=64)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--fit_epochs", type=int, default=1)
    p.add_argument("--fit_batch", type=int, default=4096, help="rows per step over all devices")
    p.add_argument("--finetune_steps", type=int, default=6)
    p.add_argument("--finetune_contexts", type=int, default=4, help="contexts per step over all devices")
    p.add_argument("--samples", type=int, default=8, help="rollouts per context")
    p.add_argument("--context_tokens", type=int, default=2048)
    p.add_argument("--continuation_tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("results/scale-out"))
    a = p.parse_args()

    accelerator = resolve_accelerator(a.accelerator)
    available = torch.cuda.device_count() if accelerator == "cuda" else a.devices
    counts = [1] + ([a.devices] if 1 < a.devices <= available else [])
    notes = []
    if a.devices > available:
        notes.append(f"{a.devices} devices asked, {available} GPU(s) here: N=1 only")
    if accelerator == "cpu":
        notes.append(f"CPU processes (gloo) sharing {os.cpu_count()} cores: checks the script, not GPU scaling")
    records, digests = [], {}
    for n in counts:
        record = {"devices": n, "accelerator": accelerator}
        folder = a.out / f"collect-n{n}"
        start = time.perf_counter()
        collect(
            model=a.model, corpus=a.corpus, windows=a.windows, window_tokens=a.window_tokens,
            future_queries=a.future_queries, topk=a.topk, out=folder, start_over=True, device=accelerator, devices=n,
        )  # fmt: skip
        record["collect_wall_s"] = time.perf_counter() - start
        record["collect_windows_per_s"] = collect_rate(folder, n)
        digests[n] = digest(folder)

        root = a.out / f"fit-n{n}"
        start = time.perf_counter()
        fit_main([
            "fit", "--config", "configs/fit.yaml", "--data.folder", str(folder), "--data.batch_size", str(a.fit_batch),
            "--data.num_workers", "0", "--trainer.max_epochs", str(a.fit_epochs), *lightning_args(accelerator, n, root),
        ])  # fmt: skip
        record["fit_wall_s"] = time.perf_counter() - start
        steps_per_s, record["fit_steps"] = step_rate(next(root.rglob("version_0")), "train/loss")
        record["fit_samples_per_s"] = steps_per_s * a.fit_batch

        checkpoint = next((a.out / "fit-n1").rglob("last.ckpt"))
        root = a.out / f"finetune-n{n}"
        start = time.perf_counter()
        finetune_main([
            "--config", "configs/finetune.yaml", "--model.predictor", str(checkpoint), "--model.model", a.model,
            "--model.samples", str(a.samples), "--data.corpus", a.corpus, "--data.tasks", "[]",
            "--data.windows", str(max(a.windows, a.finetune_contexts)), "--data.context_tokens", str(a.context_tokens),
            "--data.continuation_tokens", str(a.continuation_tokens), "--data.batch_size", str(a.finetune_contexts),
            "--trainer.max_steps", str(a.finetune_steps), *lightning_args(accelerator, n, root),
        ])  # fmt: skip
        record["finetune_wall_s"] = time.perf_counter() - start
        steps_per_s, record["finetune_steps"] = step_rate(next(root.rglob("version_0")), "train/reward")
        record["finetune_rollouts_per_s"] = steps_per_s * a.finetune_contexts * a.samples
        records.append(record)
    if len(counts) > 1:
        same = digests[1] == digests[a.devices]
        notes.append(f"{a.devices}-process collection {'equals' if same else 'DIFFERS from'} the 1-process one")

    rows = ["| devices | collect windows/s | fit samples/s | finetune rollouts/s | wall s (collect, fit, finetune) |",
            "|---|---|---|---|---|"]
    for r in records:
        speed = "" if r is records[0] else " ({:.2f}x, {:.2f}x, {:.2f}x)".format(
            *(r[k] / records[0][k] for k in ("collect_windows_per_s", "fit_samples_per_s", "finetune_rollouts_per_s"))
        )
        rows.append(
            f"| {r['devices']} {r['accelerator']}{speed} | {r['collect_windows_per_s']:.3f} "
            f"| {r['fit_samples_per_s']:.0f} | {r['finetune_rollouts_per_s']:.2f} "
            f"| {r['collect_wall_s']:.0f}, {r['fit_wall_s']:.0f}, {r['finetune_wall_s']:.0f} |"
        )
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    settings["gpu"] = torch.cuda.get_device_name() if accelerator == "cuda" else None
    paths = write_report(a.out, "\n".join(rows), {"settings": settings, "records": records, "notes": notes},
                         json_name="results.json", notes="\n".join(f"- {n}" for n in notes))
    print("\n".join(rows + notes))
    print(f"wrote {paths['markdown']} and {paths['json']}")


if __name__ == "__main__":
    main()
