"""Fit draft heads on a frozen target.

    accelerate launch training/train_heads.py --config configs/smollm2-135m-instruct-eagle.yaml [--key value ...]
    accelerate launch --config_file configs/accelerate/deepspeed-zero2.yaml training/train_heads.py \\
        --config configs/llama-3.1-8b-instruct-eagle.yaml

One process, several processes (data parallel) or DeepSpeed ZeRO all go through accelerate; the loop below
does not know which. Checkpoints (`<output_dir>.train-state/step-N`) are written atomically every
`save_every` steps; `--resume` continues from the newest with the same data order and random state (and
trains nothing when that one already ran its steps). A loss or weights that stop being finite end the run.
The final heads are written to `output_dir` with `heads.save_heads` (config.json + model.safetensors).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by accelerate: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.trainer_pt_utils import LengthGroupedSampler

from heads import (
    DraftVocabulary,
    EagleConfig,
    EagleHead,
    EarlyExitConfig,
    LayerShape,
    MedusaConfig,
    TargetFingerprint,
    build_heads,
    load_heads,
    most_frequent_tokens,
    save_heads,
)
from heads.config import HeadConfigError, check_feature_layers, dataclass_from_dict
from heads.files import check_output_dir, file_in_the_way
from heads.io import non_finite_parameters
from inference import load_target
from inference.target import warn_if_slow_bfloat16
from training.config import ConfigError, TrainConfig, load_config
from training.data import build_datasets, collate
from training.features import WithFeatures, cache_features, find_features
from training.losses import eagle_loss, early_exit_loss, medusa_loss, target_features

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_large_buffers_to_the_os() -> None:
    """Serve buffers of 1 MiB and more straight from the OS, and give them back when freed (glibc). Every batch's
    activations have their own shapes; glibc's default threshold rises as large buffers are freed, after which they
    come from a heap that fragments, and a CPU run's memory grew with every step until the kernel killed it
    (docs/experiments.md, row X29). Elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # a musl libc's does nothing
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 20)


class EpochSeededLengthSampler(LengthGroupedSampler):
    """transformers' length-grouped order (random mega-batches, each sorted by length), reseeded every epoch
    so that a resumed run draws the same batches as an uninterrupted one."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int):
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(self.seed + epoch)


def head_config(cfg: TrainConfig, target_config):
    options = {k: v for k, v in cfg.head.items() if k != "kind"}
    kind = {"medusa": MedusaConfig, "eagle": EagleConfig, "early_exit": EarlyExitConfig}[cfg.head["kind"]]
    fixed = dict(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size)
    clash = sorted(set(options) & set(fixed))
    if clash:
        raise ConfigError(f"head.{clash[0]} comes from the target and cannot be set")
    if kind is MedusaConfig and options.get("prefix_layer") is True:  # Hydra++'s: shaped as a layer of the target
        options["prefix_layer"] = LayerShape.for_target(target_config)
    defaults = kind.for_target(target_config)
    config = dataclass_from_dict(kind, {**defaults.__dict__, **options}, "head")
    check_feature_layers(config, target_config, "head.feature_layers: the head")
    if getattr(config, "own_lm_heads", False):
        raise ConfigError(
            "head.own_lm_heads is for Medusa heads read from FasterDecoding's files; heads trained here project with "
            "the target's lm_head"
        )
    return config


def warm_start(heads, path: str, target) -> None:
    """Start `heads` from the checkpoint at `path` (fitted on this target; same kind and shape).

    Two exceptions to "same shape": an EAGLE head that fuses several target layers including the final one
    (-1) may start from a head that reads -1 alone (EAGLE-1). Its fuse layer then starts as a selector of -1,
    so the new head computes exactly what the old one did, and training only has to learn what the other
    layers add (EAGLE-3's low layers carry the current token's identity, which copying from the context needs).
    And a head with `copy_input` may start from one without: the new input's weights start at zero. Likewise
    sequential Medusa heads with a prefix layer may start from the same heads without one: the layer starts as
    built, passing the target's states through unchanged.
    """
    try:
        source = load_heads(path, target)
    except HeadConfigError as error:
        raise ConfigError(f"init_from: {error}") from None
    if type(source) is not type(heads):
        raise ConfigError(
            f"init_from: {path} holds {source.config.kind} heads, but this recipe trains {heads.config.kind} heads"
        )
    state = source.state_dict()
    if isinstance(heads.config, EagleConfig) and source.config.feature_layers != heads.config.feature_layers:
        new = heads.config.feature_layers
        if source.config.feature_layers != [-1] or -1 not in new:
            raise ConfigError(
                f"init_from: {path} reads target layers {source.config.feature_layers}, this head {new}; a head may "
                "only grow from the final layer alone ([-1]) to several layers that include it (or keep its layers)"
            )
        hidden, at = heads.config.hidden_size, new.index(-1)
        selector = torch.zeros(hidden, len(new) * hidden)
        selector[:, at * hidden : (at + 1) * hidden] = torch.eye(hidden)
        state = {**heads.state_dict(), **state, "fuse.weight": selector}  # the new layers' norms start as built
    if isinstance(heads.config, EagleConfig) and heads.config.copy_input and not source.config.copy_input:
        # a head may also grow a copy input: its fc columns start at zero, so it computes what it did
        state["fc.weight"] = torch.cat(
            [state["fc.weight"], torch.zeros_like(state["fc.weight"][:, : heads.config.hidden_size])], dim=1
        )
    if isinstance(heads.config, MedusaConfig) and heads.prefix is not None and source.prefix is None:
        state = {**{f"prefix.{name}": t for name, t in heads.prefix.state_dict().items()}, **state}
    try:
        heads.load_state_dict(
            {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
        )
    except RuntimeError as error:
        raise ConfigError(
            f"init_from: {path} does not fit this recipe's head ({error}); keep its head settings, e.g. "
            "draft_vocab_size"
        ) from None


def compute_loss(cfg: TrainConfig, heads, layers: tuple[int, ...], draft_ids, target, batch):
    """`heads` may be wrapped (DDP, DeepSpeed): it is only ever called, so gradients are synchronised."""
    lm_head = target.get_output_embeddings()
    vocab = DraftVocabulary(lm_head, draft_ids)  # the target's view: labels and soft targets
    head = getattr(heads, "module", heads)  # unwrapped: a head with a projection of its own drafts through it (eagle3)
    draft_vocab = head.draft_vocabulary(lm_head) if isinstance(head, EagleHead) else vocab
    if cfg.head["kind"] == "early_exit" and not cfg.early_exit_soft_labels:  # the labels are the text: no target pass
        return early_exit_loss(
            heads, vocab, None, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], cfg.loss_tokens
        )
    if "features" in batch:
        features = {layer: f.float() for layer, f in batch["features"].items()}
    else:
        features = target_features(target, batch["input_ids"], batch["attention_mask"], layers)
    if cfg.head["kind"] == "early_exit":
        return early_exit_loss(
            heads, vocab, features[-1], batch["input_ids"], batch["attention_mask"], batch["loss_mask"], cfg.loss_tokens
        )
    if cfg.head["kind"] == "medusa":
        sequential = head.config.sequential  # the heads read the text's tokens, through the target's embeddings
        return medusa_loss(
            heads,
            vocab,
            features[-1],
            batch["input_ids"],
            batch["loss_mask"],
            cfg.medusa_decay,
            cfg.loss_tokens,
            cfg.medusa_soft_labels,
            embed=target.get_input_embeddings() if sequential else None,
            num_heads=head.config.num_heads,
        )
    return eagle_loss(
        heads,
        layers,
        target.get_input_embeddings(),
        lm_head,
        vocab,
        features,
        batch["input_ids"],
        batch["loss_mask"],
        draft_vocab=draft_vocab,
        regression_weight=cfg.eagle_regression_weight,
        ce_weight=cfg.eagle_ce_weight,
        noise=cfg.eagle_noise,
        unroll=cfg.eagle_unroll,
        max_tokens=cfg.loss_tokens,
        copy_input=bool(cfg.head.get("copy_input", False)),
    )


@torch.no_grad()
def evaluate(cfg, heads, layers, draft_ids, target, loader, accelerator) -> dict:
    heads.eval()
    sums, count = {}, 0
    for batch in loader:
        loss, metrics = compute_loss(cfg, heads, layers, draft_ids, target, batch)
        for key, value in {"loss": float(loss), **metrics}.items():
            sums[key] = sums.get(key, 0.0) + value
        count += 1
    heads.train()
    means = torch.tensor([sums[k] / max(count, 1) for k in sorted(sums)], device=accelerator.device)
    means = accelerator.reduce(means, reduction="mean")
    return {f"eval/{k}": v for k, v in zip(sorted(sums), means.tolist())}


def save_checkpoint(accelerator, root: Path, state: dict, keep: int) -> None:
    """accelerate's full state (heads, optimizer, scheduler, RNG) + our counters, renamed into place."""
    final = root / f"step-{state['step']:07d}"
    staging = root / f".step-{state['step']:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()  # every rank writes its own random state: all of them, before the rename
    if accelerator.is_main_process:
        (staging / "trainer_state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def checkpoint_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def run_is_over(state: dict, cfg: TrainConfig) -> bool:
    out_of_time = cfg.max_minutes is not None and state["train_seconds"] > 60 * cfg.max_minutes
    return state["step"] >= cfg.max_steps or out_of_time


def check_state_dir(root: Path) -> None:
    """Checkpoints go to `root`: it must be a folder, or a path where one can be made."""
    blocking = file_in_the_way(root)
    if blocking is not None:
        raise ConfigError(
            f"cannot keep training checkpoints in {root}: {blocking} is a file, not a folder; set state_dir (or "
            "output_dir) elsewhere"
        )


def remove_stale_staging(root: Path) -> None:
    """A run killed while writing a checkpoint leaves its staging folder behind (save_checkpoint names them)."""
    for staging in root.glob(".step-*.tmp"):
        shutil.rmtree(staging)


def diverged(step: int, problem: str, cfg: TrainConfig, root: Path) -> str:
    """The message that stops a run whose loss or weights are no longer finite."""
    again = f"train again (after moving {root} away)" if latest_checkpoint(root) else "train again"
    return (
        f"training diverged at step {step}: {problem}; nothing from this step on was saved. Lower learning_rate "
        f"(now {cfg.learning_rate}) or raise warmup_steps (now {cfg.warmup_steps}) and {again}"
    )


def shut_down(accelerator) -> None:
    accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a recipe in configs/*.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    parser.add_argument(
        "--prepare-data",
        action="store_true",
        help="only build (and cache) the training data (and features, with cache_features), then exit",
    )
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        checkpoints = Path(cfg.state_dir or f"{cfg.output_dir}.train-state")
        if not args.prepare_data:  # refused now, not after hours of training
            check_output_dir(cfg.output_dir)
            check_state_dir(checkpoints)
    except HeadConfigError as error:
        parser.error(str(error))

    return_large_buffers_to_the_os()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.resolve_auto_precision(device_type)
    if cfg.mixed_precision == "bf16":
        warn_if_slow_bfloat16(torch.bfloat16, device_type, "mixed_precision bf16")
    # several CPU processes talk over gloo; accelerate needs to be told or it counts one process per rank
    distributed_cpu = device_type == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=str(checkpoints),  # tracker logs live beside the checkpoints
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else None,
    )
    set_seed(cfg.seed)
    output = Path(cfg.output_dir)
    newest = latest_checkpoint(checkpoints)
    if not args.resume and not args.prepare_data and newest is not None:
        # a fresh run would mix its checkpoints with the earlier run's (and prune the wrong ones)
        parser.error(
            f"{checkpoints} holds checkpoints of an earlier run: pass --resume to continue it, or move it away to "
            "start afresh"
        )
    if args.resume and not args.prepare_data and newest is not None and (output / "config.json").is_file():
        done = checkpoint_state(newest)
        if run_is_over(done, cfg):  # resuming would train past the end and overwrite the finished heads
            accelerator.print(
                f"the run is finished (step {done['step']}, max_steps {cfg.max_steps}); its heads are at {output}. "
                "Raise --max_steps (or --max_minutes) to train further."
            )
            shut_down(accelerator)
            return {
                "steps": done["step"],
                "resumed_from": done["step"],
                "history": done.get("eval_history", []),
                "output": str(output),
                "weights_sha256": None,
            }
    if accelerator.is_main_process:
        remove_stale_staging(checkpoints)

    target, tokenizer = load_target(cfg.model, dtype=cfg.target_dtype, device=accelerator.device, compile=False)
    target.requires_grad_(False)
    fingerprint = TargetFingerprint.of(target)
    try:  # mistakes in the recipe surface here (before any data is prepared): a clear message, not a traceback
        config = head_config(cfg, target.config)
        heads = build_heads(config, target)
        if cfg.init_from:  # its draft vocabulary comes with it: its projection rows were learned for those tokens
            warm_start(heads, cfg.init_from, target)
            accelerator.print(f"starting from the heads at {cfg.init_from}")
        with accelerator.main_process_first():
            train_set, eval_set = build_datasets(
                cfg.data, tokenizer, target, fingerprint.weights_sha256, cfg.seed, accelerator.is_main_process
            )
    except HeadConfigError as error:
        parser.error(str(error))
    accelerator.print(
        f"data: {len(train_set)} training sequences ({sum(map(sum, train_set['loss_mask']))} loss tokens), "
        f"{len(eval_set)} held out"
    )
    layers = tuple(getattr(config, "feature_layers", (-1,)))
    rows = train_set
    if cfg.cache_features:
        started = time.perf_counter()
        with accelerator.main_process_first():
            directory, held = find_features(
                Path(cfg.data.cache_dir), fingerprint.weights_sha256, rows, layers, target.dtype
            )
            store = cache_features(
                target, rows, held, directory, cfg.batch_size, accelerator.is_main_process, serve=layers
            )
        if held != sorted(set(layers) | {-1}):
            accelerator.print(f"features: reading layers {list(layers)} from {directory}, which holds {held}")
        train_set = WithFeatures(rows, store)
        gib = store.nbytes / 2**30
        accelerator.print(f"features: {gib:.2f} GiB in {directory} ({time.perf_counter() - started:.0f} s)")
    if args.prepare_data:
        return {"steps": 0, "resumed_from": 0, "history": [], "output": None, "weights_sha256": None}
    if (
        heads.draft_ids is not None and not cfg.init_from
    ):  # the draft vocabulary: the most frequent tokens of the training answers
        ids, covered, total = most_frequent_tokens(
            ([t for t, m in zip(x["input_ids"], x["loss_mask"]) if m] for x in rows),
            config.draft_vocab_size,
            config.vocab_size,
        )
        heads.draft_ids.copy_(ids)
        accelerator.print(
            f"draft vocabulary: {len(ids)} tokens cover {covered / max(total, 1):.1%} of the training answers' tokens"
        )
    if (
        isinstance(heads, EagleHead) and config.architecture == "eagle3" and not cfg.init_from
    ):  # its own lm_head starts as the target's rows
        with torch.no_grad():
            projection = target.get_output_embeddings().weight
            heads.lm_head.weight.copy_(
                projection if heads.draft_ids is None else projection[heads.draft_ids.to(projection.device)]
            )
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(
        {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_schedule],
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # own generators: starting a loader's iterator must not draw from the global RNG, or a resumed run
    # (which starts one mid-epoch) would shift the noise and position sampling of an uninterrupted one
    # padding costs a step as much as real tokens: length grouping keeps it out of the batches
    sampler = (
        EpochSeededLengthSampler([len(ids) for ids in rows["input_ids"]], cfg.batch_size, cfg.seed)
        if cfg.group_by_length
        else None
    )
    loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        collate_fn=collate(pad),
        generator=torch.Generator().manual_seed(cfg.seed),
        # features read from disk: a worker reads the next batches while this process trains on this one
        num_workers=1 if cfg.cache_features else 0,
    )
    eval_loader = DataLoader(
        eval_set, batch_size=cfg.batch_size, collate_fn=collate(pad), generator=torch.Generator().manual_seed(cfg.seed)
    )
    heads, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        heads, optimizer, loader, eval_loader, scheduler
    )
    draft_ids = accelerator.unwrap_model(heads).draft_ids  # after prepare: on the training device
    accelerator.init_trackers("specheads", config={k: str(v) for k, v in cfg.to_dict().items()})

    # the held-out curve lives in the checkpointed state, so a resumed run's checkpoint keeps all of it
    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "train_seconds": 0.0, "eval_history": []}
    if args.resume:
        if newest is None:
            accelerator.print(f"--resume: no checkpoint in {checkpoints}, starting from scratch")
        else:
            accelerator.load_state(str(newest))
            state = {**state, **checkpoint_state(newest)}  # older checkpoints lack eval_history
            accelerator.print(f"resumed from {newest} (step {state['step']})")
    resumed_from, history = state["step"], state["eval_history"]

    progress = tqdm(
        total=cfg.max_steps, initial=state["step"], desc="training", disable=not accelerator.is_local_main_process
    )
    started, metrics = time.perf_counter() - state["train_seconds"], {}
    heads.train()
    # a run killed after its last checkpoint but before writing its heads trains nothing more: they are written below
    finished = run_is_over(state, cfg)
    while not finished:
        loader.set_epoch(state["epoch"])
        epoch_loader = (
            accelerator.skip_first_batches(loader, state["batches_in_epoch"]) if state["batches_in_epoch"] else loader
        )
        for batch in epoch_loader:
            with accelerator.accumulate(heads):
                loss, metrics = compute_loss(cfg, heads, layers, draft_ids, target, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state["batches_in_epoch"] += 1
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            state["train_seconds"] = time.perf_counter() - started
            progress.update(1)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                progress.close()
                parser.error(diverged(state["step"], f"the loss is {loss_value}", cfg, checkpoints))
            progress.set_postfix(
                loss=f"{loss_value:.3f}", **{k: f"{v:.2f}" for k, v in metrics.items() if k.startswith("top1")}
            )
            if state["step"] % cfg.log_every == 0:
                logged = {
                    "train/loss": loss_value,
                    "train/lr": scheduler.get_last_lr()[0],
                    **{f"train/{k}": v for k, v in metrics.items()},
                }
                accelerator.log(logged, step=state["step"])
            finished = run_is_over(state, cfg)
            if state["step"] % cfg.eval_every == 0 or finished:
                results = evaluate(cfg, heads, layers, draft_ids, target, eval_loader, accelerator)
                accelerator.log(results, step=state["step"])
                history.append({"step": state["step"], **results})
                if accelerator.is_main_process:
                    progress.write(f"step {state['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
            if state["step"] % cfg.save_every == 0 or finished:
                broken = non_finite_parameters(accelerator.unwrap_model(heads).state_dict())
                if broken:  # the loss was finite, the update that followed was not
                    progress.close()
                    parser.error(
                        diverged(
                            state["step"],
                            f"the weights hold NaN or infinity ({', '.join(broken[:3])})",
                            cfg,
                            checkpoints,
                        )
                    )
                save_checkpoint(accelerator, checkpoints, state, cfg.keep_checkpoints)
            if finished:
                break
        else:  # the epoch ran out before the steps did
            state["epoch"] += 1
            state["batches_in_epoch"] = 0
    progress.close()

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(heads)
        if cfg.head["kind"] == "medusa" and history:  # the default tree is fitted to the measured accuracies
            last = history[-1]
            model.config.rank_accuracy = [
                [round(last.get(f"eval/top1/depth{d}", 0.0), 4)]
                + [round(last.get(f"eval/rank{r}/depth{d}", 0.0), 4) for r in range(2, 5)]
                for d in range(2, model.config.num_heads + 2)
            ]
        training = {
            "config": cfg.to_dict(),
            "steps": state["step"],
            "train_seconds": round(state["train_seconds"], 1),
            "sequences": len(rows),
            "tokens": int(sum(sum(m) for m in rows["loss_mask"])),
            # the held-out curve travels with the weights
            "eval_history": [{k: round(v, 4) for k, v in entry.items()} for entry in history],
        }
        try:  # the output folder is checked at the start, but something may have been put there since
            save_heads(model, output, target, training=training)
        except HeadConfigError as error:
            parser.error(str(error))
        accelerator.print(
            f"saved heads to {output} after {state['step']} steps ({state['train_seconds'] / 60:.1f} min)"
        )
    # every rank reports its weights: data-parallel ranks must end identical
    digest = hashlib.sha256(
        b"".join(p.detach().float().cpu().numpy().tobytes() for p in accelerator.unwrap_model(heads).parameters())
    ).hexdigest()
    print(f"rank {accelerator.process_index}: weights sha256 {digest[:16]}", flush=True)
    shut_down(accelerator)
    return {
        "steps": state["step"],
        "resumed_from": resumed_from,
        "history": history,
        "output": str(output),
        "weights_sha256": digest,
    }


if __name__ == "__main__":
    from inference.cli import run

    run(main, "train_heads.py")
