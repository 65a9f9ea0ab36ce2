"""Supervised training of the RelevanceMLP on collected shards (`atskv fit`), in Lightning.

Loss = `bce_weight` x BCE(logit, in_topk) + `ranking_weight` x a pairwise logistic loss on
`mass`: for each row, `ranking_pairs` partners are drawn from its own group (one window,
decision time, managed layer and KV head) and the model is asked to order each pair as their
masses are. BCE alone learns the top-k boundary; the ranking term also orders tokens inside and
outside it, which matters when the selector's budget differs from the collection's k.

Choices where the plan leaves one:
- Batches hold whole groups (shuffled per epoch), so every row has partners for the ranking
  loss; with rows shuffled freely across millions of groups almost no pair would share a batch.
- The train/validation split is by shard key with `data.seed`, independent of
  `seed_everything`: the three seeds (`atskv fit fit --config configs/fit.yaml
  --seed_everything N`, N = 0, 1, 2) differ in initialisation and batch order, not in the
  held-out windows, so their validation numbers compare.
- Mass recall (`MassRecall`) is the share of a group's sampled mass that the predicted top-k_g
  captures, over the share the true top-k_g captures, k_g = the group's positives: the
  quantity a selector keeping k_g tokens cares about. The checkpoint keeps the best epoch by it.
- The feature spec comes from the shards' manifest and is saved in the hyperparameters, so a
  checkpoint reloads with `RelevanceModule.load_from_checkpoint(path)` alone.
- Training runs on one device: the group batch sampler is not sharded for DDP (the MLP is
  ~110K parameters; data loading, not compute, bounds it).
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader, Sampler
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat

from atskv.eval.figures import save_figure
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.predictor.shards import ShardDataset, stacked

COLUMNS = ["hidden", "scalars", "token_type", "layer", "head", "mass", "in_topk", "group"]
MONITOR = "val/mass_recall"


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


def pairwise_ranking_loss(logits: torch.Tensor, mass: torch.Tensor, group: torch.Tensor, pairs: int) -> torch.Tensor:
    """Logistic loss softplus(-(s_i - s_j)) over `pairs` random same-group partners j per row i,
    oriented so that i has the larger mass; pairs of equal mass are skipped."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    by_group = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    i = torch.arange(len(logits), device=logits.device).repeat(pairs)
    g = inverse[i]
    offset = (torch.rand(len(i), device=logits.device) * counts[g]).long().clamp_max(counts[g] - 1)
    j = by_group[starts[g] + offset]
    sign = torch.sign(mass[i].float() - mass[j].float())
    keep = sign != 0
    if not keep.any():
        return logits.sum() * 0
    return F.softplus(-sign[keep] * (logits[i] - logits[j])[keep]).mean()


class GroupBatchSampler(Sampler[list[int]]):
    """Batches of whole groups, about `batch_size` rows each (a larger group is a batch alone).

    With `shuffle`, each pass over the data draws a new group order from a seed taken from the
    global RNG at construction (so `seed_everything` fixes it); without, groups keep their order.
    """

    def __init__(self, group: torch.Tensor, batch_size: int, shuffle: bool):
        _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
        self.rows = torch.argsort(inverse, stable=True).split(counts.tolist())  # row indices per group
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(torch.randint(2**62, ()).item())
        self.epoch = 0
        self._batches = self._pack(range(len(self.rows)))

    def _pack(self, order) -> list[list[int]]:
        """Group ids per batch, filled in `order`."""
        batches, current, size = [], [], 0
        for g in order:
            if current and size + len(self.rows[g]) > self.batch_size:
                batches.append(current)
                current, size = [], 0
            current.append(g)
            size += len(self.rows[g])
        return batches + [current] if current else batches

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self.epoch += 1
            self._batches = self._pack(torch.randperm(len(self.rows), generator=generator).tolist())
        for batch in self._batches:
            yield torch.cat([self.rows[g] for g in batch]).tolist()

    def __len__(self) -> int:
        return len(self._batches)


class RelevanceData(L.LightningDataModule):
    """Collected shards in `folder`, split into train / validation by shard key."""

    def __init__(
        self,
        folder: str = "data/collect",
        batch_size: int = 4096,
        validation_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 0,
    ):
        """
        Args:
            folder: a shard folder written by `atskv collect`.
            batch_size: rows per batch, filled with whole groups.
            validation_fraction: share of the shard keys (windows) held out for validation.
            num_workers: DataLoader worker processes.
            seed: the train/validation split (kept fixed across training seeds).
        """
        super().__init__()
        self.save_hyperparameters()
        dataset = ShardDataset(folder, COLUMNS)
        if len(dataset) == 0:
            raise ValueError(f"{folder} lists no finished shards: run `atskv collect` into it first")
        if "feature_spec" not in dataset.meta:
            raise ValueError(f"{folder}'s manifest has no feature_spec: not a predictor collection")
        self.dataset = dataset
        self.feature_spec = FeatureSpec.from_dict(dataset.meta["feature_spec"])
        self.collection = dataset.meta  # base model, geometry, managed layers: what `atskv export` needs
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            fraction, seed = self.hparams.validation_fraction, self.hparams.seed
            self.train_set, self.val_set = self.dataset.split_by_key(fraction, seed)

    def _loader(self, dataset: ShardDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=GroupBatchSampler(dataset.column("group"), self.hparams.batch_size, shuffle),
            collate_fn=stacked,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


class RelevanceModule(L.LightningModule):
    """The RelevanceMLP with its losses, optimiser and metrics."""

    def __init__(
        self,
        collection: dict,
        reduced_width: int = 64,
        hidden: int = 768,
        layer_embedding: int = 8,
        head_embedding: int = 4,
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
            reduced_width: width of the hidden-state projection (d_r).
            hidden: hidden units of the MLP.
            layer_embedding: size of the learned managed-layer embedding.
            head_embedding: size of the learned KV-head embedding.
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            bce_weight: weight of BCE on top-k membership.
            ranking_weight: weight of the pairwise ranking loss on mass (0 disables it).
            ranking_pairs: same-group partners drawn per row for the ranking loss.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = RelevanceMLP(
            FeatureSpec.from_dict(collection["feature_spec"]), reduced_width, hidden, layer_embedding, head_embedding
        )
        self.train_auroc, self.val_auroc = BinaryAUROC(), BinaryAUROC()
        self.train_recall, self.val_recall = MassRecall(), MassRecall()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["hidden"], batch["scalars"], batch["token_type"], batch["layer"], batch["head"])

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch)
        loss = logits.new_zeros(())
        if self.hparams.bce_weight:
            bce = F.binary_cross_entropy_with_logits(logits, batch["in_topk"].float())
            loss = loss + self.hparams.bce_weight * bce
            self.log(f"{stage}/bce", bce, on_step=stage == "train", on_epoch=stage == "val")
        if self.hparams.ranking_weight:
            rank = pairwise_ranking_loss(logits, batch["mass"], batch["group"], self.hparams.ranking_pairs)
            loss = loss + self.hparams.ranking_weight * rank
            self.log(f"{stage}/ranking", rank, on_step=stage == "train", on_epoch=stage == "val")
        self.log(f"{stage}/loss", loss, on_step=stage == "train", on_epoch=stage == "val", prog_bar=True)
        auroc, recall = getattr(self, f"{stage}_auroc"), getattr(self, f"{stage}_recall")
        auroc.update(logits.detach(), batch["in_topk"].long())
        recall.update(logits, batch["mass"], batch["in_topk"], batch["group"])
        self.log(f"{stage}/auroc", auroc, on_step=False, on_epoch=True)
        self.log(f"{stage}/mass_recall", recall, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class RelevanceCLI(LightningCLI):
    """LightningCLI with the collection's meta linked from the data and a checkpoint on mass recall."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.collection", "model.collection", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": MONITOR,
                "checkpoint.mode": "max",
                "checkpoint.filename": "epoch{epoch}-recall{val/mass_recall:.4f}",
                "checkpoint.auto_insert_metric_name": False,
                "checkpoint.save_last": True,
            }
        )


def fit_main(args: list[str] | None = None) -> RelevanceCLI:
    """`atskv fit`: e.g. `fit --config configs/fit.yaml [--seed_everything N]`; run it with
    N = 0, 1, 2 for the three seeds (same validation windows, see the module docstring)."""
    with warnings.catch_warnings():  # `atskv fit` passes its own argv on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return RelevanceCLI(
            RelevanceModule, RelevanceData, args=args, save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "atskv"},
        )


CURVES = (("train/loss", "val/loss"), ("val/mass_recall",))


def training_curves(log_dir: str | Path, out_png: str | Path) -> Path:
    """Draw train/val loss and val mass recall per step for every run (event-file folder) under
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
