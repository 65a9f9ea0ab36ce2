"""Supervised training of the RelevanceMLP on collected shards (`atskv fit`), in Lightning.

Loss = `bce_weight` x BCE(logit, in_topk) + `ranking_weight` x a pairwise logistic loss on the
collection's label score (`mass`, or `kvzip` for a `--label kvzip` collection; `label_column`):
for each row, `ranking_pairs` partners are drawn from its own group (one window, decision time,
managed layer and KV head) and the model is asked to order each pair as their scores are. BCE
alone learns the top-k boundary; the ranking term also orders tokens inside and outside it,
which matters when the selector's budget differs from the collection's k.

Choices where the plan leaves one:
- Batches hold whole groups (shuffled per epoch), so every row has partners for the ranking
  loss; with rows shuffled freely across millions of groups almost no pair would share a batch.
- The train/validation split is by shard key with `data.seed`, independent of
  `seed_everything`: the three seeds (`atskv fit fit --config configs/fit.yaml
  --seed_everything N`, N = 0, 1, 2) differ in initialisation and batch order, not in the
  held-out windows, so their validation numbers compare.
- Mass recall (`MassRecall`, `val/mass_recall`) is the share of a group's sampled mass (label
  score) that the predicted top-k_g captures, over the share the true top-k_g captures, k_g = the
  group's positives. The sample is the true top-k plus as many others, so it sits near 0.99 and
  hardly tells checkpoints apart.
- Window recall (`WindowRecall`, `val/window_recall`) is the same ratio over the groups of the
  held-out windows a collection keeps whole (`atskv collect --full_windows N`): of every token
  0..t, the predicted top-k_g against the true top-k_g: the quantity a selector keeping k_g tokens
  cares about. The checkpoint keeps the best epoch by it when the validation split has such
  groups, else by mass recall (`RelevanceCLI.before_fit`). Losses, AUROC and mass recall read the
  `sampled` rows only, so they mean what they mean on a collection without full windows.
- Full windows in the training split train on their `sampled` rows only (the loader skips the
  rest): exactly the rows a sampled collection would hold, so the training data and its class
  balance do not depend on how many windows were kept whole.
- The feature spec comes from the shards' manifest and is saved in the hyperparameters, so a
  checkpoint reloads with `RelevanceModule.load_from_checkpoint(path)` alone.
- Data parallel (`trainer.devices: N`, Lightning DDP) computes the same steps as one process:
  `data.batch_size` counts the rows of all processes together and every process takes a share
  of each batch's groups (`atskv.predictor.batches`); losses are means over the whole batch,
  the scalar BatchNorm uses the whole batch's statistics and ranking partners are drawn from
  counters keyed by group, row and step (`atskv.predictor.distributed`); metrics are torchmetrics,
  reduced over processes; checkpoints and TensorBoard logs come from rank 0.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat

from atskv.errors import OneLineParseErrors
from atskv.figures import save_figure
from atskv.predictor.batches import GroupBatchSampler
from atskv.predictor.distributed import counter_hash, global_means, globalise_batch_norms
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.predictor.shards import ShardDataset, full_windows, label_column, stacked

FEATURES = ["hidden", "scalars", "token_type", "layer", "head"]
MONITOR = "val/window_recall"  # the checkpoint's metric when the validation split has full groups
FALLBACK_MONITOR = "val/mass_recall"  # otherwise (e.g. a collection made without --full_windows)


def checkpoint_filename(monitor: str) -> str:
    """The default checkpoint file name for checkpoints kept by `monitor`."""
    return f"epoch{{epoch}}-{'recall' if monitor == FALLBACK_MONITOR else monitor.split('/')[-1]}{{{monitor}:.4f}}"


def training_columns(meta: dict) -> list[str]:
    """The shard columns a fit reads from a collection with manifest `meta`: the features, the
    top-k membership, the group and the label score, plus `full` and `sampled` when some windows
    were kept whole (`atskv.predictor.collect`)."""
    return [*FEATURES, "in_topk", "group", label_column(meta), *(["full", "sampled"] if full_windows(meta) else [])]


def _rank_within_groups(group: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Rank (0 = largest `value`) of each row among the rows of its group."""
    order = torch.argsort(value, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]  # by group, then by value descending
    _, counts = torch.unique_consecutive(group[order], return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=group.device) - starts
    return rank


def mass_recall(preds: torch.Tensor, mass: torch.Tensor, in_topk: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean over groups of (mass in the predicted top-k_g) / (mass in the true top-k_g), k_g = the
    group's positives; groups without positives or mass are left out."""
    ids, inverse = torch.unique(group, return_inverse=True)
    n = len(ids)
    k = torch.zeros(n, device=group.device).index_add_(0, inverse, in_topk.float())
    mass = mass.float()

    def captured(ranking: torch.Tensor) -> torch.Tensor:
        kept = _rank_within_groups(inverse, ranking) < k[inverse]
        return torch.zeros(n, device=group.device).index_add_(0, inverse, mass * kept)

    oracle = captured(mass)
    valid = (k > 0) & (oracle > 0)
    if not valid.any():
        return torch.tensor(float("nan"), device=group.device)
    return (captured(preds.float())[valid] / oracle[valid]).mean()


class MassRecall(Metric):
    """`mass_recall` over everything seen since the last reset (groups may span batches)."""

    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name in ("preds", "mass", "in_topk", "group"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, mass: torch.Tensor, in_topk: torch.Tensor, group: torch.Tensor) -> None:
        self.preds.append(preds.detach().float())
        self.mass.append(mass.float())
        self.in_topk.append(in_topk.bool())
        self.group.append(group.long())

    def compute(self) -> torch.Tensor:
        return mass_recall(*(dim_zero_cat(s) for s in (self.preds, self.mass, self.in_topk, self.group)))


class WindowRecall(MassRecall):
    """`mass_recall` fed the rows of full groups only (every token 0..t of a window, `full`): the
    share of the whole window's mass (label score) the predicted top-k_g keeps, over the true
    top-k_g's share. k_g = the group's positives, which in a full group is min(topk, t+1): the
    collection's k read from the rows themselves, and the same k `val/mass_recall` uses."""


def pairwise_ranking_loss(
    logits: torch.Tensor, mass: torch.Tensor, group: torch.Tensor, pairs: int, seed: int = 0
) -> torch.Tensor:
    """Per-pair logistic losses softplus(-(s_i - s_j)) over `pairs` same-group partners j per row
    i, oriented so that i has the larger mass; pairs of equal mass are left out.

    Partners are drawn by `counter_hash(seed, group, row's place in its group, draw)`, not from
    an RNG stream, so a row gets the same partners however the batch is split over processes."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    by_group = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(by_group)
    place[by_group] = torch.arange(len(by_group), device=group.device) - starts[inverse[by_group]]
    i = torch.arange(len(logits), device=logits.device).repeat(pairs)
    draw = torch.arange(pairs, device=logits.device).repeat_interleave(len(logits))
    g = inverse[i]
    offset = counter_hash(seed, group[i], place[i], draw) % counts[g]
    j = by_group[starts[g] + offset]
    sign = torch.sign(mass[i].float() - mass[j].float())
    keep = sign != 0
    return F.softplus(-sign[keep] * (logits[i] - logits[j])[keep])


def default_workers() -> int:
    """Data-loader workers for this machine: half its usable cores, at most 4 (the main process
    trains on the rest; more workers than cores only slows reading)."""
    return min(4, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else 0


class RelevanceData(L.LightningDataModule):
    """Collected shards in `folder`, split into train / validation by shard key."""

    def __init__(
        self,
        folder: str = "data/collect",
        batch_size: int = 4096,
        validation_fraction: float = 0.1,
        num_workers: int | None = None,
        seed: int = 0,
    ):
        """
        Args:
            folder: a shard folder written by `atskv collect`.
            batch_size: rows per optimiser step over all processes, filled with whole groups.
            validation_fraction: share of the shard keys (windows) held out for validation.
            num_workers: DataLoader worker processes; None: from the cores (`default_workers`).
            seed: the train/validation split (kept fixed across training seeds).
        """
        super().__init__()
        self.save_hyperparameters()
        self.num_workers = default_workers() if num_workers is None else num_workers
        meta = ShardDataset(folder, []).meta
        if "feature_spec" not in meta:
            raise ValueError(f"{folder}'s manifest has no feature_spec: not a predictor collection")
        dataset = ShardDataset(folder, training_columns(meta))
        if len(dataset) == 0:
            raise ValueError(f"{folder} lists no finished shards: run `atskv collect` into it first")
        self.dataset = dataset
        self.feature_spec = FeatureSpec.from_dict(dataset.meta["feature_spec"])
        self.collection = dataset.meta  # base model, geometry, managed layers: what `atskv export` needs
        self.train_set = self.val_set = None
        self.full_validation = False  # the validation split has full groups (set by `setup`)
        self.shuffle_seed = int(torch.randint(2**62, ()))  # drawn after seed_everything, the same in every process

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            fraction, seed = self.hparams.validation_fraction, self.hparams.seed
            first = self.collection.get("full_keys", ())  # the full windows go to validation first
            self.train_set, self.val_set = self.dataset.split_by_key(fraction, seed, first)
            self.full_validation = self.val_set.has_full_groups()

    def _loader(self, dataset: ShardDataset, shuffle: bool, sampled_only: bool = False) -> DataLoader:
        """Batches of whole groups; `sampled_only`: only the rows of a sample (full groups' others skipped)."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        keep = dataset.column("sampled") if sampled_only and "sampled" in dataset.columns else None
        sampler = GroupBatchSampler(
            dataset.column("group"), self.hparams.batch_size, shuffle, self.shuffle_seed, rank, world, keep
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=stacked,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True, sampled_only=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)  # full groups whole, for the window recall


class RelevanceModule(L.LightningModule):
    """The RelevanceMLP with its losses, optimiser and metrics."""

    def __init__(
        self,
        collection: dict,
        reduced_width: int = 64,
        hidden: int = 768,
        layer_embedding: int = 8,
        head_embedding: int = 4,
        without: list[str] = [],  # noqa: B006 (read-only; a list for the CLI)
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        bce_weight: float = 1.0,
        ranking_weight: float = 1.0,
        ranking_pairs: int = 4,
    ):
        """
        Args:
            collection: the collection's manifest meta (feature spec, base model, geometry, managed
                layers; the CLI links it from the data), kept in checkpoints for `atskv export`.
            reduced_width: width of the hidden-state projection (d_r); 0 leaves the hidden state out.
            hidden: hidden units of the MLP.
            layer_embedding: size of the learned managed-layer embedding.
            head_embedding: size of the learned KV-head embedding.
            without: inputs left out (ablations): scalar features by name and/or token_type.
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            bce_weight: weight of BCE on top-k membership.
            ranking_weight: weight of the pairwise ranking loss on mass (0 disables it).
            ranking_pairs: same-group partners drawn per row for the ranking loss.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = RelevanceMLP(
            FeatureSpec.from_dict(collection["feature_spec"]), reduced_width, hidden, layer_embedding, head_embedding,
            without,
        )
        self.label = label_column(collection)
        self.train_auroc, self.val_auroc = BinaryAUROC(), BinaryAUROC()
        self.train_recall, self.val_recall = MassRecall(), MassRecall()
        self.val_window_recall = WindowRecall()
        self.validates_windows = False  # the datamodule's validation split has full groups (`setup`)
        self.val_losses = nn.ModuleDict({name: MeanMetric() for name in ("loss", "bce", "ranking")})
        self.pair_seed = int(torch.randint(2**62, ()))  # ranking partners; drawn after seed_everything

    def setup(self, stage: str) -> None:
        self.validates_windows = bool(getattr(self.trainer.datamodule, "full_validation", False))
        if self.trainer.world_size > 1:
            globalise_batch_norms(self.model)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["hidden"], batch["scalars"], batch["token_type"], batch["layer"], batch["head"])

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        hp = self.hparams
        logits = self(batch)
        if stage == "val" and self.validates_windows:
            full = batch["full"]
            window = (logits[full], batch[self.label][full], batch["in_topk"][full], batch["group"][full])
            self.val_window_recall.update(*window)
            self.log("val/window_recall", self.val_window_recall, on_step=False, on_epoch=True, prog_bar=True)
        if "sampled" in batch and not batch["sampled"].all():  # the rest of a full group: window recall only
            keep = batch["sampled"]
            logits, batch = logits[keep], {c: batch[c][keep] for c in ("in_topk", "group", self.label)}
        bce = F.binary_cross_entropy_with_logits(logits, batch["in_topk"].float(), reduction="sum")
        pairs = logits[:0]
        if hp.ranking_weight:
            seed = self.pair_seed + self.global_step
            pairs = pairwise_ranking_loss(logits, batch[self.label], batch["group"], hp.ranking_pairs, seed)
        shares, means = global_means(torch.stack([bce, pairs.sum()]), torch.tensor([logits.numel(), pairs.numel()]))
        loss = hp.bce_weight * shares[0] + hp.ranking_weight * shares[1]  # this process's share of the batch's loss
        rows = means.new_tensor(float(len(logits)))  # the batch's value is every process's: weigh it by local rows
        values = {"loss": hp.bce_weight * means[0] + hp.ranking_weight * means[1], "bce": means[0]}
        if hp.ranking_weight:
            values["ranking"] = means[1]
        for name, value in values.items():
            if stage == "train":
                self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=1)
            else:
                self.val_losses[name].update(value, rows)
                self.log(f"val/{name}", self.val_losses[name], prog_bar=name == "loss")
        auroc, recall = getattr(self, f"{stage}_auroc"), getattr(self, f"{stage}_recall")
        auroc.update(logits.detach(), batch["in_topk"].long())
        recall.update(logits, batch[self.label], batch["in_topk"], batch["group"])
        self.log(f"{stage}/auroc", auroc, on_step=False, on_epoch=True)
        self.log(f"{stage}/mass_recall", recall, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class OneLineLightningParser(OneLineParseErrors, LightningArgumentParser):
    """`atskv fit`'s and `atskv finetune`'s parser: a parse error is one line and exit code 2."""


class ReleaseProcessGroup(Callback):
    """Destroys the process group when a fit ends, in each process. Lightning does so at exit for
    NCCL only; a gloo group left to interpreter shutdown can abort its process (its worker threads
    still hold tensors then, pytorch/pytorch#179291), which failed a 2-process CPU fit at random."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RelevanceCLI(LightningCLI):
    """LightningCLI with the collection's meta linked from the data and a checkpoint on the window
    recall, or the mass recall when the validation split has no full groups."""

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's own, with its progress bar (written to stdout) on stderr (a private method of
        LightningCLI: check on a Lightning upgrade)."""
        with contextlib.redirect_stdout(sys.stderr):
            super()._run_subcommand(subcommand)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.collection", "model.collection", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": MONITOR,
                "checkpoint.mode": "max",
                "checkpoint.filename": checkpoint_filename(MONITOR),
                "checkpoint.auto_insert_metric_name": False,
                "checkpoint.save_last": True,
                "trainer.use_distributed_sampler": False,  # the group batch sampler shards itself
            }
        )

    def before_instantiate_classes(self) -> None:
        """A TensorBoard run given no name of its own is named after the collection's folder
        (`runs/fit/<model>/version_N` for `data/collect/<model>`), not Lightning's `lightning_logs`
        for every model."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        logger = config["trainer"].get("logger")
        tensorboard = getattr(logger, "class_path", "").endswith(".TensorBoardLogger")
        if tensorboard and logger.init_args.get("name") in (None, "", "lightning_logs"):
            logger.init_args.name = Path(config["data"]["folder"]).name

    def before_fit(self) -> None:
        """Without full groups in the validation split there is no `val/window_recall`: the default
        monitor (and file name) falls back to `val/mass_recall`; a monitor the user chose stays."""
        callback = self.trainer.checkpoint_callback
        if callback is None or callback.monitor != MONITOR:
            return
        self.datamodule.setup("fit")
        if self.datamodule.full_validation:
            return
        if full_windows(self.datamodule.collection):
            rank_zero_warn(
                f"none of the collection's {full_windows(self.datamodule.collection)} full windows is in the "
                f"validation split: checkpoints are kept by {FALLBACK_MONITOR} (collect more with --full_windows)"
            )
        callback.monitor = FALLBACK_MONITOR
        if callback.filename == checkpoint_filename(MONITOR):
            callback.filename = checkpoint_filename(FALLBACK_MONITOR)


def fit_main(args: list[str] | None = None) -> RelevanceCLI:
    """`atskv fit`: e.g. `fit --config configs/fit.yaml [--seed_everything N]`; run it with
    N = 0, 1, 2 for the three seeds (same validation windows, see the module docstring)."""
    with warnings.catch_warnings():  # `atskv fit` passes its own argv on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return RelevanceCLI(
            RelevanceModule, RelevanceData, args=args, save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "atskv"}, parser_class=OneLineLightningParser,
            trainer_defaults={"callbacks": [ReleaseProcessGroup()]},
        )


def fit_predictor(
    folder: str | Path, out: str | Path, *, epochs: int = 4, seed: int = 0, progress: bool = True, **options
) -> Path:
    """Train a predictor on the shards in `folder` without the CLI (what `atskv fit` does with the
    defaults of `RelevanceModule` and `RelevanceData`; `options` override either's by name) on the
    CPU or the one GPU; returns the checkpoint of the last epoch, `out/last.ckpt`, for
    `export_checkpoint`."""
    from inspect import signature

    L.seed_everything(seed, verbose=False)
    data_keys = set(signature(RelevanceData.__init__).parameters) - {"self"}
    unknown = set(options) - data_keys - set(signature(RelevanceModule.__init__).parameters)
    if unknown:
        raise TypeError(f"fit_predictor got unknown options {sorted(unknown)}")
    data = RelevanceData(str(folder), **{k: v for k, v in options.items() if k in data_keys})
    module = RelevanceModule(data.collection, **{k: v for k, v in options.items() if k not in data_keys})
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=progress, use_distributed_sampler=False,
        default_root_dir=str(out), log_every_n_steps=10,
    )  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # Lightning's progress bar writes to stdout
        trainer.fit(module, datamodule=data)
    path = Path(out) / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


CURVES = (("train/loss", "val/loss"), ("val/mass_recall", "val/window_recall"))


def training_curves(log_dir: str | Path, out_png: str | Path) -> Path:
    """Draw train/val loss and val mass (and window) recall per step for every run (event-file folder) under
    `log_dir`, e.g. the three seeds' versions, into `out_png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(log_dir)
    runs = sorted({p.parent for p in log_dir.rglob("events.out.tfevents.*")})
    if not runs:
        raise FileNotFoundError(f"no TensorBoard event files under {log_dir}")
    fig, axes = plt.subplots(1, len(CURVES), figsize=(6 * len(CURVES), 4))
    colours = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for run, colour in zip(runs, colours):
        events = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
        tags = set(events.Tags()["scalars"])
        label = str(run.relative_to(log_dir)) if run != log_dir else run.name
        for ax, names in zip(axes, CURVES):
            for name, style in zip(names, ("-", "--")):
                if name in tags:
                    points = events.Scalars(name)
                    ax.plot([p.step for p in points], [p.value for p in points], style, color=colour,
                            marker="o" if name.startswith("val") else None, markersize=3, label=f"{label} {name}")
    for ax, names in zip(axes, CURVES):
        ax.set_xlabel("step")
        ax.set_title(" / ".join(names))
        ax.legend(fontsize="small")
    return save_figure(fig, out_png)
