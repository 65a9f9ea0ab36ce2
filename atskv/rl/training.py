"""Policy-gradient fine-tuning of the relevance predictor (`atskv finetune`), in Lightning.

Every training item (a corpus window or a task prompt, `atskv.rl.items`) is one context: the
predictor scores its tokens, the policy samples K retentions, and the base model scores the
continuation under each (`atskv.rl.rollout`). The reward is `R = alpha * performance - (1 -
alpha) * memory` (`atskv.rl.reward`); the loss of one context is

    loss = -(alpha * mean_k(A_k * log pi(a_k)) - (1 - alpha) * E[memory]) - entropy_weight * H + kl_weight * KL

- Performance by REINFORCE: A_k is the leave-one-out advantage of sample k's performance (-NLL,
  or exact match) over the K samples of the context; its gradient is an unbiased estimate of
  the gradient of E[performance].
- Memory exactly: E[memory] is a closed-form function of the logits (`Policy.expected_memory`:
  the mean keep probability for Bernoulli), so its gradient is taken by autograd. Estimating it
  by REINFORCE as well drowned it: with ~10^5 independent keep decisions per context the K
  samples differ in memory an order of magnitude less than in NLL, so alpha hardly reached the
  gradient (docs/results/kernel-notes.md). For Gumbel top-k memory is k / N whatever is sampled: the term is
  a constant and only performance is learned.
- One scale: R is per context, with memory a mean over the D token decisions (managed layers x
  KV heads x context tokens); H (nats) and KL are means over the same decisions. So
  entropy_weight is reward per nat of mean entropy and kl_weight reward per nat of mean KL, to
  weigh against (1 - alpha) per unit of retained fraction and alpha per nat of NLL, at any
  context length. Per logit of keep probability p, memory pulls with (1 - alpha) p (1 - p) / D,
  the entropy bonus towards p = 1/2 with entropy_weight |l| p (1 - p) / D and (Bernoulli) the KL
  back to the supervised logit with kl_weight |l - l_sup| p (1 - p) / D: with the defaults
  (1e-3, 1e-2) memory dominates both unless |l| > 1000 (1 - alpha) or the logit has moved by
  more than 100 (1 - alpha). (An earlier version divided the REINFORCE term alone by D: entropy
  and KL then weighed D times more than stated, ~170,000x at 2K tokens for SmolLM2.)

H, KL: per-token entropy of the policy and keep-marginal KL to the frozen supervised predictor
(`atskv.rl.policy`).

Choices where the plan leaves one:
- Manual optimisation: the items of a batch are backpropagated one by one (each graph is freed
  before the next rollout), then the gradient norm is clipped to `gradient_clip` and AdamW steps.
- Data parallel (`trainer.devices: N`): a step's `batch_size` contexts are dealt to the
  processes (`atskv.predictor.batches`), each runs its rollouts, and the gradients are summed
  over processes once per step (DDP's per-backward reduction is off: processes may hold
  different numbers of contexts). Each context's samples are drawn from a seed of its tokens
  and the step, so N processes take the steps one process takes.
- The predictor runs as it does at inference all through training: its BatchNorm keeps the
  running statistics of the supervised phase (eval mode), so scores mean the same at run time.
- Performance is -NLL on corpus windows; on task prompts -NLL too, or exact-match in {0, 1} with
  `task_metric: exact_match` (sparser: a context whose K samples all agree gives no gradient).
- The base model is frozen and lives outside the module's parameters and state: checkpoints
  hold the predictor as `model.*` and the hyperparameters `collection` and the MLP widths, the
  form `RelevanceModule` writes, so `atskv export` reads a fine-tuning checkpoint unchanged (and
  `atskv finetune --model.predictor CKPT` continues from one); `started_from` (the predictor read
  and its own provenance) goes into the exported header beside alpha, policy and samples. The
  frozen reference predictor is rebuilt from `predictor` when a module is made, not saved.
- Initialisation: `predictor` is an exported predictor (folder or .safetensors), a training
  checkpoint (.ckpt, from `atskv fit` or `atskv finetune`), or a model name whose predictor is
  found as the CLI finds it (the user's export, else the one shipped with atskv).
- Task prompts for training draw their seeds from `TASK_SEED_BASE` on, like the collection's;
  held-out evaluation uses another range (`atskv.rl.evaluate`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

from atskv.features import SCALAR_FEATURES
from atskv.models import DEFAULT_MODEL, ModelGeometry, resolve_device
from atskv.predictor.batches import GroupBatchSampler
from atskv.predictor.capture import managed_layers
from atskv.predictor.collect import TASK_SEED_BASE
from atskv.predictor.distributed import all_sum, seeded
from atskv.predictor.export import PredictorHeader, checkpoint_provenance, load_predictor, predictor_path
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.predictor.token_types import token_type_table
from atskv.predictor.training import OneLineLightningParser, ReleaseProcessGroup
from atskv.rl.items import RolloutItem, corpus_items, task_items
from atskv.rl.policy import Policy, Selection, make_policy, marginal_kl
from atskv.rl.reward import check_alpha, leave_one_out, reward
from atskv.rl.rollout import context_features, predictor_logits, retrieved_tokens, rollout

TASK_METRICS = ("nll", "exact_match")
STATISTICS = ("loss", "reward", "entropy", "kl", "expected_memory", "nll", "memory", "exact")  # logged per step


@dataclass
class StartingPoint:
    """The supervised predictor fine-tuning starts from, and what `atskv export` needs to know."""

    mlp: RelevanceMLP
    collection: dict  # model, geometry, feature_spec, managed_layers (a collection manifest's keys)
    source: str  # the file or folder it was read from
    training: dict  # its own provenance (an exported header's `training`, or a checkpoint's)

    @property
    def header(self) -> PredictorHeader:
        c = self.collection
        return PredictorHeader(
            c["model"],
            ModelGeometry.from_dict(c["geometry"]),
            tuple(c["managed_layers"]),
            FeatureSpec.from_dict(c["feature_spec"]),
            self.mlp.arguments(),
        )


def starting_point(source: str | Path) -> StartingPoint:
    """Read the predictor to start from: a .ckpt, an exported predictor, or a model name."""
    path = Path(source).expanduser()
    if path.suffix == ".ckpt":
        from atskv.predictor.checkpoints import load_module, read_checkpoint
        from atskv.predictor.training import RelevanceModule

        module = load_module(RelevanceModule, path)
        # from the file, not `module.hparams`: built while `atskv finetune`'s LightningCLI instantiates
        # the policy module, its save_hyperparameters records the CLI's arguments for that one
        collection = read_checkpoint(path)["hyper_parameters"]["collection"]
        start = StartingPoint(module.model, dict(collection), str(path), checkpoint_provenance(path))
    else:
        folder = predictor_path(source)
        loaded = load_predictor(folder)
        h = loaded.header
        if not isinstance(loaded.mlp, RelevanceMLP):
            raise ValueError(f"{folder} holds a {h.kind} scorer; fine-tuning starts from an MLP predictor")
        collection = {
            "model": h.base_model,
            "geometry": h.geometry.to_dict(),
            "feature_spec": h.feature_spec.to_dict(),
            "managed_layers": list(h.managed_layers),
        }
        start = StartingPoint(loaded.mlp, collection, str(folder), h.training)
    features = tuple(start.collection["feature_spec"]["scalar_features"])
    if features != SCALAR_FEATURES:
        raise ValueError(f"the predictor reads features {features}, this version of atskv computes {SCALAR_FEATURES}")
    return start


def policy_loss(
    policy: Policy,
    logits: torch.Tensor,
    selection: Selection,
    performance: torch.Tensor,
    alpha: float,
    reference_logits: torch.Tensor,
    entropy_weight: float,
    kl_weight: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one context (see the module docstring) and its parts, detached, for logging.
    `logits` `[*rows, N]`; `selection` K samples from them; `performance` `[K]` of the samples."""
    alpha = check_alpha(alpha)
    performance = performance.detach().float()
    surrogate = (leave_one_out(performance) * policy.log_prob(logits, selection)).mean()
    expected_memory = policy.expected_memory(logits)
    entropy = policy.entropy(logits, selection)
    kl = marginal_kl(policy, logits, reference_logits.detach())
    loss = -(alpha * surrogate - (1 - alpha) * expected_memory) - entropy_weight * entropy + kl_weight * kl
    rewards = reward(performance, selection.memory, alpha)
    return loss, {
        "loss": loss.detach(),
        "reward": rewards.mean(),
        "entropy": entropy.detach(),
        "kl": kl.detach(),
        "expected_memory": expected_memory.detach(),
    }


@dataclass
class _Frozen:
    """What the module uses but never trains or saves (kept off its parameters and state dict)."""

    base: torch.nn.Module  # the base model
    reference: RelevanceMLP  # the supervised predictor, for the KL term
    type_table: torch.Tensor  # token type of every id


class PolicyGradientModule(L.LightningModule):
    """Policy gradient on the predictor (REINFORCE for performance, the exact gradient of memory)
    with rollouts through the frozen base model."""

    def __init__(
        self,
        predictor: str = DEFAULT_MODEL,
        model: str | None = None,
        policy: str = "row_level",
        budget: int | float = 0.1,
        temperature: float = 1.0,
        alpha: float = 0.5,
        samples: int = 8,
        task_metric: str = "nll",
        retrieve: int | float = 0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        entropy_weight: float = 1e-3,
        kl_weight: float = 1e-2,
        gradient_clip: float = 1.0,
        dtype: str = "auto",
    ):
        """
        Args:
            predictor: the supervised predictor to start from: an exported predictor (folder or
                .safetensors), a checkpoint of `atskv fit` / `atskv finetune` (.ckpt), or a model
                name (its exported or shipped predictor).
            model: the base model (named model, Hugging Face folder or .gguf); default: the one the
                predictor was trained for. Its geometry must be the predictor's.
            policy: bernoulli (keep each token with p = sigmoid(logit / temperature); memory
                varies), gumbel_topk (sample `budget` tokens per layer and KV head; memory fixed)
                or row_level (each layer and KV head samples how much it keeps, the ranking is
                the predictor's; `atskv.rl.policy` says why).
            budget: gumbel_topk's tokens per layer and KV head (int) or fraction of the context.
            temperature: logits are divided by it before the policy reads them.
            alpha: reward = alpha * performance - (1 - alpha) * memory, alpha in [0, 1].
            samples: K, retentions sampled per context (>= 2, for the leave-one-out baseline).
            task_metric: performance on task prompts: nll (-NLL of the answer) or exact_match.
            retrieve: training for a two-tier store: each continuation query reads back this many
                of the tokens a sample drops, per layer and KV head, those it rates highest
                (int: tokens; float: a fraction of the context); 0: what is dropped is gone.
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            entropy_weight: reward per nat of the policy's mean entropy per token decision.
            kl_weight: reward lost per nat of the mean KL per token decision to the supervised
                predictor.
            gradient_clip: the gradient's norm is clipped to this before each step.
            dtype: the base model's dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU).
        """
        super().__init__()
        self.automatic_optimization = False
        check_alpha(alpha)
        self.policy = make_policy(policy, budget, temperature)
        if samples < 2:
            raise ValueError(f"samples must be >= 2 (the leave-one-out baseline), got {samples}")
        if task_metric not in TASK_METRICS:
            raise ValueError(f"task_metric must be one of {TASK_METRICS}, got {task_metric!r}")
        retrieved_tokens(retrieve, 1)  # checked before the model loads
        self.save_hyperparameters()
        from atskv.models import load_model  # looked up at call time (tests check nothing loads before the checks)

        start = starting_point(predictor)
        loaded = load_model(model or start.collection["model"])
        start.header.check_model(loaded.model)
        self.layers = tuple(start.collection["managed_layers"])
        hooked = managed_layers(loaded.model, self.layers[0])
        if hooked != list(self.layers):
            raise ValueError(f"the predictor covers layers {list(self.layers)}, the hook would manage {hooked}")
        self.model = start.mlp.requires_grad_(True)
        reference = copy.deepcopy(start.mlp).eval().requires_grad_(False)
        types = token_type_table(loaded.tokenizer, loaded.model.config.get_text_config(decoder=True).vocab_size)
        self.frozen = _Frozen(loaded.model.eval().requires_grad_(False), reference, types)
        self.tokenizer = loaded.tokenizer
        started_from = {"predictor": start.source, "training": start.training}  # for `atskv export`'s header
        self.hparams.update(collection=start.collection, started_from=started_from, **start.mlp.arguments())
        self.sample_seed = int(torch.randint(2**62, ()))  # the policy's draws; after seed_everything

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # BatchNorm keeps the supervised phase's running statistics
        return self

    def setup(self, stage: str) -> None:
        device = self.trainer.strategy.root_device
        self.frozen.base.to(device=device, dtype=resolve_device(device.type, self.hparams.dtype)[1])
        self.frozen.reference.to(device)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and (items := datamodule.items()):
            self.policy.check(min(item.context for item in items))

    def item_loss(self, item: RolloutItem) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and statistics of one context: features, K samples, rollouts, `policy_loss`."""
        hp = self.hparams
        self.policy.check(item.context)
        features = context_features(self.frozen.base, item.ids[: item.context], self.layers, self.frozen.type_table)
        logits = predictor_logits(self.model, features)
        with torch.no_grad():
            reference = predictor_logits(self.frozen.reference, features)
        selection = self.policy.sample(logits, hp.samples)
        retrieve = retrieved_tokens(hp.retrieve, item.context)
        result = rollout(self.frozen.base, item, selection.keep, self.layers, retrieve)
        exact = item.is_task and hp.task_metric == "exact_match"
        performance = result.exact.float() if exact else -result.nll
        loss, stats = policy_loss(
            self.policy, logits, selection, performance, hp.alpha, reference, hp.entropy_weight, hp.kl_weight
        )
        stats.update(nll=result.nll.mean(), memory=selection.memory.mean())
        if item.is_task:
            stats["exact"] = result.exact.float().mean()
        return loss, stats

    def training_step(self, batch: list[RolloutItem], batch_idx: int) -> None:
        """This process's share of the step's contexts; gradients and statistics are summed over
        processes once, at the end (`batch` may be empty where the step has fewer contexts than processes)."""
        optimiser = self.optimizers()
        optimiser.zero_grad()
        contexts = all_sum(torch.tensor(float(len(batch)))).item()
        sums = torch.zeros(len(STATISTICS), dtype=torch.float64)
        counts = torch.zeros(len(STATISTICS), dtype=torch.float64)
        no_sync = getattr(self.trainer.strategy, "block_backward_sync", contextlib.nullcontext)
        with no_sync():
            for item in batch:
                with seeded(self.sample_seed, self.global_step, item.ids.tolist()):  # the same draws on any rank
                    loss, parts = self.item_loss(item)
                self.manual_backward(loss / contexts)
                for name, value in parts.items():
                    sums[STATISTICS.index(name)] += value.item()
                    counts[STATISTICS.index(name)] += 1
        params = list(self.model.parameters())
        grads = all_sum(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
        for p, g in zip(params, grads.split([p.numel() for p in params])):
            p.grad = g.view_as(p)
        norm = torch.nn.utils.clip_grad_norm_(params, self.hparams.gradient_clip)
        optimiser.step()
        sums, counts = all_sum(sums), all_sum(counts)
        logged = {f"train/{name}": sums[i] / counts[i] for i, name in enumerate(STATISTICS) if counts[i]}
        self.log_dict({**logged, "train/grad_norm": norm}, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class RolloutData(L.LightningDataModule):
    """Training contexts: corpus windows and synthetic task prompts, a few per optimiser step."""

    def __init__(
        self,
        tokenizer: Any = None,
        corpus: str = "austen",
        windows: int = 64,
        context_tokens: int = 2048,
        continuation_tokens: int = 32,
        tasks: list[str] = ["passkey", "needle_single"],  # noqa: B006 (read-only; a list for the CLI)
        task_examples: int = 16,
        task_tokens: int | None = None,
        batch_size: int = 2,
    ):
        """
        Args:
            tokenizer: the base model's (the CLI links it from the model).
            corpus: training text: a corpus name, a folder of .txt files or hf:<dataset>.
            windows: corpus windows, spread evenly over the corpus.
            context_tokens: T, the tokens a window's retention is decided on.
            continuation_tokens: C, the tokens after them whose NLL is the performance.
            tasks: synthetic tasks whose prompts (answer as continuation) are trained on too.
            task_examples: prompts per task (seeds from TASK_SEED_BASE on).
            task_tokens: length of the task prompts (default: context_tokens).
            batch_size: contexts per optimiser step, over all processes.
        """
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])
        if continuation_tokens < 2 or context_tokens < 2:
            raise ValueError(
                f"need context_tokens and continuation_tokens >= 2, got {context_tokens}, {continuation_tokens}"
            )
        self.tokenizer = tokenizer
        self._items: list[RolloutItem] | None = None
        self.shuffle_seed = int(torch.randint(2**62, ()))  # drawn after seed_everything, the same in every process

    def items(self) -> list[RolloutItem]:
        if self._items is None:
            hp = self.hparams
            if self.tokenizer is None:
                raise ValueError("RolloutData needs the base model's tokenizer")
            items = corpus_items(self.tokenizer, hp.corpus, hp.windows, hp.context_tokens, hp.continuation_tokens)
            seeds = range(TASK_SEED_BASE, TASK_SEED_BASE + hp.task_examples)
            self._items = items + task_items(self.tokenizer, hp.tasks, seeds, hp.task_tokens or hp.context_tokens)
        return self._items

    def train_dataloader(self) -> DataLoader:
        """`batch_size` contexts per step, shared by the processes (each context a group of one)."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        items = self.items()
        size = self.hparams.batch_size
        sampler = GroupBatchSampler(torch.arange(len(items)), size, True, self.shuffle_seed, rank, world)
        return DataLoader(items, batch_sampler=sampler, collate_fn=list)


class StepProgressBar(RichProgressBar):
    """Lightning's Rich bar as one bar for the run, in optimiser steps of `max_steps`: fine-tuning
    is bounded by steps, not epochs (the stock bar counts each epoch's batches under "Epoch 0/-2")."""

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps

    def _get_train_description(self, current_epoch: int) -> str:
        return "steps"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar_id is None:  # later epochs carry on in the same bar
            super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)


class FinetuneCLI(LightningCLI):
    """LightningCLI with the tokenizer linked from the model, the policy's budget checked against
    the data before anything loads, a checkpoint of the last step and a progress bar in steps."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.tokenizer", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "trainer.use_distributed_sampler": False})

    def before_instantiate_classes(self) -> None:
        model, data = self.config["model"], self.config["data"]
        check_alpha(model["alpha"])
        policy = make_policy(model["policy"], model["budget"], model["temperature"])
        contexts = [data["context_tokens"]] + ([data["task_tokens"] or data["context_tokens"]] if data["tasks"] else [])
        policy.check(min(contexts))

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The trainer; a run bounded by `max_steps` gets `StepProgressBar` where Lightning would
        add its stock Rich bar (progress bar on, none given, rich installed)."""
        config = self.config_init["trainer"]
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        stock_rich_bar = (
            config.get("enable_progress_bar") is not False
            and not any(isinstance(c, ProgressBar) for c in callbacks)
            and importlib.util.find_spec("rich") is not None
        )
        if stock_rich_bar and config.get("max_steps", -1) > 0:
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)


def finetune_main(args: list[str] | None = None) -> FinetuneCLI:
    """`atskv finetune --config configs/finetune.yaml [--seed_everything N] [--model.alpha A]`:
    parse (no Lightning subcommand: fitting is the only thing it does), then fit."""
    with warnings.catch_warnings():  # `atskv finetune` passes its own argv on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = FinetuneCLI(
            PolicyGradientModule,
            RolloutData,
            args=args,
            run=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "atskv finetune"},
            parser_class=OneLineLightningParser,
            trainer_defaults={"callbacks": [ReleaseProcessGroup()]},
        )
    with contextlib.redirect_stdout(sys.stderr):  # Lightning's progress bar writes to stdout
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli
