"""Perplexity against compression ratio: a small transformer language model on the King James Bible under AdamW.

    python benchmarks/lm.py              # every codec at its defaults + accuracy_vs_ratio.py's sweep, 3 seeds for
                                         # none, topk(0.01), powersgd(4) and signsgd (about 80 minutes on 2 cores)
    python benchmarks/lm.py --quick      # a tiny model, 4 codecs, 30 steps: a smoke test (under a minute)
    python benchmarks/lm.py --codecs none signsgd --seeds 0 1
    torchrun --nproc-per-node 8 benchmarks/lm.py   # NCCL when CUDA is there

Corpus: the King James Bible from Debian's bible-kjv (`bible -f "gen1:1-rev22:21"`: 1189 chapters, 31102
verses, 4.1 MB once the verse references are stripped), real English on any Debian machine without a
download. One verse a line. Every 20th chapter (the 11th, 31st, ...; 5% of the text, from Genesis to
Revelation) is held out whole as the validation split, so training and validation text come from the same
books but share no verse. (A single block at the end would be Hebrews to Revelation, whose vocabulary the
mostly Old-Testament training text hardly prepares for: a short run's perplexity there mostly measures that
shift.) The byte-pair vocabulary (1024 tokens, byte-level, PyPI's tokenizers) is fitted on the training
chapters only; a token is about 3 characters.

Model: a GPT-style decoder (pre-LayerNorm, causal self-attention with 64-wide heads, 4x GELU MLP, learned
positions, output projection tied to the input embedding): 3 layers of width 256 over 64 tokens, 2.6M
parameters. Sub-words rather than characters: on 2 CPU cores a character model sees too little text in a
few minutes to get past a bigram's perplexity; a token carries 3 characters for a little more compute.

Recipe: AdamW (peak 1.5e-3, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings, none on LayerNorms
and biases), linear warm-up over 5% of the steps then cosine decay to 0, gradient-norm clipping at 1.0 on the
averaged gradient, 600 steps of 32 sequences (1.2M tokens, about one pass over the training text). Every
rank draws its own random windows each step (seeded by seed, step and rank), so the data is the same for
every codec. The codec is DDP's communication hook (gloo on the CPU).

Each run records the validation loss (nats per token), perplexity per token and bits per character over the
validation split, the bytes one rank put on the wire per step and the ratio to plain DDP's, and its wall
time. Baselines on the same split: a unigram model (add-one smoothing) and a bigram model interpolated with
it, both counted on the training split. Results: lm[_quick].{json,csv,png} in --out; the PNG is perplexity
against ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]
import train_ddp as main_job  # noqa: E402 - the learning-rate schedule and the spawn helpers
from accuracy_vs_ratio import SWEEP, merged_with_earlier  # noqa: E402
from bench_common import machine, run_plan, write_results  # noqa: E402

import gradcomp  # noqa: E402

BIBLE_RANGE = "gen1:1-rev22:21"
VALIDATION_EVERY = 20  # 5% of the chapters


@dataclass(frozen=True)
class Config:
    vocab: int = 1024  # byte-pair tokens
    width: int = 256
    layers: int = 3
    context: int = 64  # tokens
    batch_per_rank: int = 16  # sequences of `context` tokens
    steps: int = 600
    peak_lr: float = 1.5e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    clip_norm: float = 1.0
    eval_windows: int = 0  # 0: the whole validation split
    optimizer: str = "adamw"  # or "sgd": Nesterov momentum 0.9, no weight decay (to tell Adam's part apart)


FULL = Config()
QUICK = Config(vocab=512, width=64, layers=2, context=32, batch_per_rank=8, steps=30, peak_lr=3e-3, eval_windows=64)

# Every codec at its defaults (the sweep holds all but bf16) and the sweep; these get 3 seeds.
SPECS = SWEEP[:2] + [("bf16", "bf16")] + SWEEP[2:]
SEEDED_SPECS = ["none", "topk:ratio=0.01", "powersgd:rank=4", "signsgd"]
QUICK_SPECS = ["none", "topk:ratio=0.01", "signsgd", "powersgd:rank=2"]


def load_chapters() -> list[str]:
    """The Bible's 1189 chapters in order, each its verses one a line without their references."""
    if shutil.which("bible") is None:
        raise SystemExit("the `bible` program is missing: install Debian's bible-kjv (apt-get install bible-kjv)")
    lines = subprocess.run(["bible", "-f", BIBLE_RANGE], capture_output=True, text=True, check=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in filter(None, lines.splitlines()):
        reference, verse = re.fullmatch(r"(.+?\d+):\d+ (.*)", line).groups()  # "1Sa12:3 ..." -> "1Sa12"
        chapters.setdefault(reference, []).append(verse)
    return ["".join(verse + "\n" for verse in verses) for verses in chapters.values()]


def fit_tokenizer(train_text: str, vocab_size: int):
    """A byte-level BPE vocabulary (GPT-2's pre-tokenizer: lossless, spaces and newlines kept) fitted on the
    training split alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(train_text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def split_corpus(chapters: list[str], vocab_size: int) -> dict:
    """Training and validation token ids: every VALIDATION_EVERY-th chapter is held out whole, and the byte-pair
    vocabulary is fitted on the training chapters only."""
    held_out = [i % VALIDATION_EVERY == VALIDATION_EVERY // 2 for i in range(len(chapters))]
    train_text = "".join(c for c, out in zip(chapters, held_out) if not out)
    val_text = "".join(c for c, out in zip(chapters, held_out) if out)
    tokenizer = fit_tokenizer(train_text, vocab_size)

    def encode(s: str) -> torch.Tensor:
        lines = tokenizer.encode_batch(s.splitlines(keepends=True))
        return torch.tensor([i for line in lines for i in line.ids], dtype=torch.int16 if vocab_size < 2**15 else
                            torch.int32)

    return {"train": encode(train_text), "val": encode(val_text), "vocab_size": tokenizer.get_vocab_size(),
            "train_chars": len(train_text), "val_chars": len(val_text)}


def ngram_baselines(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> dict:
    """Validation perplexity per token of a unigram model (add-one smoothing) and of a bigram model
    interpolated with it, the weight chosen on the last 10% of the training split, all counted on train."""
    def counts(ids):
        unigram = torch.bincount(ids, minlength=vocab_size).double() + 1
        pairs = torch.bincount(ids[:-1] * vocab_size + ids[1:], minlength=vocab_size**2).double().view(
            vocab_size, vocab_size)
        return unigram / unigram.sum(), pairs / pairs.sum(1, keepdim=True).clamp(min=1)

    def bigram_nll(model, weight, ids):
        unigram, bigram = model
        return -(weight * bigram[ids[:-1], ids[1:]] + (1 - weight) * unigram[ids[1:]]).log().mean().item()

    train, val = train.long(), val.long()
    dev_cut = int(len(train) * 0.9)
    dev_model = counts(train[:dev_cut])
    weight = min((w / 20 for w in range(1, 20)), key=lambda w: bigram_nll(dev_model, w, train[dev_cut:]))
    unigram, bigram = counts(train)
    unigram_nll = -unigram[val].log().mean().item()
    nll = bigram_nll((unigram, bigram), weight, val)
    return {"unigram_ppl": math.exp(unigram_nll), "bigram_ppl": math.exp(nll), "unigram_loss": unigram_nll,
            "bigram_loss": nll, "bigram_weight": weight}


class Block(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.heads = width // 64 or 1
        self.ln_attention, self.ln_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.attention_out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp_in, self.mlp_out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        for projection in (self.attention_out, self.mlp_out):  # GPT-2's scaling of the residual branches
            nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, width = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).view(batch, time_, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, time_, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))


class Transformer(nn.Module):
    def __init__(self, vocab_size: int, config: Config):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, config.width)
        self.position = nn.Embedding(config.context, config.width)
        for table in (self.embedding, self.position):
            nn.init.normal_(table.weight, std=0.02)
        self.blocks = nn.Sequential(*(Block(config.width, config.layers) for _ in range(config.layers)))
        self.ln_out = nn.LayerNorm(config.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embedding(ids) + self.position.weight[: ids.shape[1]])
        return self.ln_out(hidden) @ self.embedding.weight.T  # tied output projection


def register_codec(ddp: DistributedDataParallel, spec: str, scheme: str):
    """gradcomp's hook for `spec` (lm_variants.py puts pure-PyTorch stand-ins here)."""
    return gradcomp.register(ddp, spec, scheme=scheme)


def check_spec(spec: str) -> None:
    gradcomp.codec(spec)  # a clear error for a bad spec, before any rank starts


def make_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.peak_lr, momentum=0.9, nesterov=True)
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": config.weight_decay},
                              {"params": others, "weight_decay": 0.0}], lr=config.peak_lr, betas=(0.9, 0.95))


CLIP_IN_OPTIMIZER = False  # lm_variants.py's optimizers that clip by a norm of their own set it


def clip_gradients(model: nn.Module, config: Config) -> torch.Tensor:
    """Clips the averaged gradient to config.clip_norm (unless the optimizer clips); returns its norm before."""
    return nn.utils.clip_grad_norm_(model.parameters(), float("inf") if CLIP_IN_OPTIMIZER else config.clip_norm)


def training_batch(train: torch.Tensor, config: Config, seed: int, step: int, rank: int) -> torch.Tensor:
    """batch_per_rank random windows of context + 1 tokens, the same for a (seed, step, rank) in every run."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1024 + rank)
    starts = torch.randint(0, len(train) - config.context - 1, (config.batch_per_rank, 1), generator=generator)
    return train[starts + torch.arange(config.context + 1)].long()


@torch.no_grad()
def validation_loss(model: nn.Module, val: torch.Tensor, config: Config, world: int, rank: int,
                    device: torch.device) -> float:
    """Mean loss per token over non-overlapping windows of the validation split, shared among the ranks."""
    model.eval()
    windows = (len(val) - 1) // config.context
    if config.eval_windows:
        windows = min(windows, config.eval_windows)
    inputs = val[: windows * config.context].view(windows, config.context).long()
    targets = val[1: windows * config.context + 1].view(windows, config.context).long()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in zip(inputs[rank::world].split(32), targets[rank::world].split(32)):
        logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").double()
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def sharded(model: Transformer, spec: str, device: torch.device):
    """--fsdp: every block and then the whole model under FSDP2 (fully_shard) on the run's device, and
    gradcomp.fsdp's reduce-scatter; returns (the model to call, the state)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import gradcomp.fsdp
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # not fully_shard's default: the accelerator's
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, gradcomp.fsdp.register(model, spec)


def train_one(corpus: dict, config: Config, spec: str, seed: int, world: int, rank: int,
              device: torch.device, scheme: str = "auto", fsdp: bool = False) -> dict:
    """One run; returns rank 0's view of the result (every rank computes the same)."""
    torch.manual_seed(seed)
    model = Transformer(corpus["vocab_size"], config).to(device)
    if fsdp:
        ddp, state = sharded(model, spec, device)
        optimizer = make_optimizer(model, config)  # on the sharded parameters
    else:
        optimizer = make_optimizer(model, config)  # first: lm_variants.py's optimizers hand the hook what it needs
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        state = register_codec(ddp, spec, scheme)
    warmup = max(int(config.steps * config.warmup_fraction), 1)
    train_losses, diverged_at = [], None
    started = time.perf_counter()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = main_job.scheduled_lr(config.peak_lr, step, config.steps, warmup)
        batch = training_batch(corpus["train"], config, seed, step, rank).to(device)
        loss = F.cross_entropy(ddp(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The norm of the averaged gradient is the same on every rank, so every rank stops at the same step.
        grad_norm = clip_gradients(model, config)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2's parameters are DTensors, and so is their norm
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            diverged_at = step
            break
        optimizer.step()
        train_losses.append(loss.item())
    train_seconds = time.perf_counter() - started
    val_loss = (validation_loss(model, corpus["val"], config, world, rank, device) if diverged_at is None
                else float("inf"))
    total = state.stats()["total"]
    steps_done = max(len(train_losses), 1)
    return {"spec": spec, "full_spec": state.spec, "seed": seed, "val_loss": val_loss,
            "val_ppl": math.exp(val_loss) if math.isfinite(val_loss) else float("inf"),
            "bits_per_char": val_loss * len(corpus["val"]) / corpus["val_chars"] / math.log(2),
            "diverged_at_step": diverged_at,
            "final_train_loss": statistics.fmean(train_losses[-20:]) if train_losses else float("nan"),
            "steps": len(train_losses), "wire_bytes_per_step": total["wire_bytes"] / steps_done,
            "raw_bytes_per_step": total["raw_bytes"] / steps_done,
            "ratio": total["raw_bytes"] / total["wire_bytes"] if total["wire_bytes"] else float("nan"),
            "world_size": world, "schemes": state.stats().get("schemes", "fsdp" if fsdp else None),
            "fsdp": fsdp, "start_iter": getattr(state, "start_iter", None), "train_seconds": train_seconds,
            "seconds": time.perf_counter() - started}


def rank_main(rank: int, world: int, backend: str, plan: list, corpus: dict, args, results_path: str):
    def run_one(item, device):
        family, spec, seed = item
        run = train_one(corpus, args.config, spec, seed, world, rank, device, args.scheme, args.fsdp)
        run.update(family=family, date=time.strftime("%Y-%m-%d"))
        return run

    def describe(run):
        stopped = f"  diverged at step {run['diverged_at_step']}" if run["diverged_at_step"] is not None else ""
        return (f"{run['spec']:32s} seed {run['seed']}: val ppl {run['val_ppl']:7.3f} ({run['bits_per_char']:.3f} "
                f"bits/char)  ratio {run['ratio']:7.1f}x  {run['seconds']:6.1f} s{stopped}")

    run_plan(rank, world, backend, plan, run_one, describe, results_path, args.threads)


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and range over seeds per spec, in sweep order, with the perplexity against uncompressed's."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["family"], run["spec"]), []).append(run)
    order = {spec: i for i, (_, spec) in enumerate(SPECS)}
    rows = []
    for (family, spec), members in sorted(groups.items(), key=lambda g: order.get(g[0][1], len(order))):
        ppls = [m["val_ppl"] for m in members]
        rows.append({"family": family, "spec": spec, "seeds": len(members), "ppl_mean": statistics.fmean(ppls),
                     "ppl_std": statistics.stdev(ppls) if len(ppls) > 1 and all(map(math.isfinite, ppls)) else 0.0,
                     "ppl_min": min(ppls), "ppl_max": max(ppls),
                     "bits_per_char": statistics.fmean(m["bits_per_char"] for m in members),
                     "diverged": sum(m["diverged_at_step"] is not None for m in members),
                     "ratio": statistics.fmean(m["ratio"] for m in members),
                     "wire_bytes_per_step": statistics.fmean(m["wire_bytes_per_step"] for m in members),
                     "raw_bytes_per_step": members[0]["raw_bytes_per_step"],
                     "seconds": statistics.fmean(m["train_seconds"] for m in members)})
    base = next((r for r in rows if r["spec"] == "none"), None)
    for row in rows:
        row["ppl_vs_none_pct"] = 100 * (row["ppl_mean"] / base["ppl_mean"] - 1) if base else float("nan")
        row["time_vs_none"] = row["seconds"] / base["seconds"] if base else float("nan")
    return rows


def plot(rows: list[dict], baselines: dict, world: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    base = next((r for r in rows if r["spec"] == "none"), None)
    families = list(dict.fromkeys(r["family"] for r in rows if r["spec"] != "none"))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    markers = dict(zip(families, "osD^v<>ph*Xd"))
    if base:
        ax.axhline(base["ppl_mean"], color="black", linestyle="--", linewidth=1,
                   label=f"uncompressed ({base['ppl_mean']:.2f})")
        ax.axhspan(base["ppl_mean"], base["ppl_mean"] * 1.03, color="black", alpha=0.1, label="within 3%")
    for name, style in (("bigram", ":"), ("unigram", "-.")):
        ax.axhline(baselines[f"{name}_ppl"], color="grey", linestyle=style, linewidth=1,
                   label=f"{name} model ({baselines[f'{name}_ppl']:.1f})")
    finite = [r["ppl_mean"] for r in rows if math.isfinite(r["ppl_mean"])]
    top = max(finite + [baselines["unigram_ppl"]]) * 1.3
    for family in families:
        points = sorted((r for r in rows if r["family"] == family), key=lambda r: r["ratio"])
        shown = [p for p in points if math.isfinite(p["ppl_mean"])]
        if shown:
            ax.errorbar([p["ratio"] for p in shown], [p["ppl_mean"] for p in shown],
                        yerr=[[p["ppl_mean"] - p["ppl_min"] for p in shown],
                              [p["ppl_max"] - p["ppl_mean"] for p in shown]],
                        color=colors[family], marker=markers[family], capsize=3, label=family,
                        linestyle="-" if len(shown) > 1 else "none")
        for p in points:
            if not math.isfinite(p["ppl_mean"]):  # a run that diverged: an arrow at the top
                ax.annotate("diverged", xy=(p["ratio"], top), xytext=(0, -16), textcoords="offset points",
                            ha="center", fontsize=7, color=colors[family],
                            arrowprops={"arrowstyle": "->", "color": colors[family]})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=top)
    ax.set_xlabel("compression ratio (raw bytes / bytes on the wire, log scale)")
    ax.set_ylabel("validation perplexity per token (log scale, lower is better)")
    seeds = max(r["seeds"] for r in rows)
    ax.set_title(f"transformer LM on the King James Bible under AdamW, {world} ranks\n"
                 f"(mean and range over up to {seeds} seeds)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 4 codecs, 30 steps, one seed")
    parser.add_argument("--codecs", nargs="+", metavar="SPEC", help="only these specs (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int,
                        help="every spec's seeds (default: 0 1 2 for none, topk(0.01), powersgd(4), signsgd, "
                             "0 for the rest; quick: 0)")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument("--batch-per-rank", type=int, help="override the sequences per rank per step")
    parser.add_argument("--peak-lr", type=float, help="override the peak learning rate")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"],
                        help="adamw (default), or SGD with Nesterov momentum 0.9 to compare (give --peak-lr)")
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--scheme", default="auto", choices=gradcomp.schemes.SCHEME_OPTIONS,
                        help="how signsgd, terngrad, qsgd and topk travel (auto: the one sending fewer bytes)")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 (fully_shard on every block and the model) with gradcomp.fsdp instead of DDP; "
                             "results lm_fsdp[_quick].* (powersgd is not available there)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the results in --out")
    parser.add_argument("--fresh", action="store_true",
                        help="drop earlier results in --out (default: keep the runs this invocation does not redo)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    overrides = {"steps": args.steps, "batch_per_rank": args.batch_per_rank, "peak_lr": args.peak_lr,
                 "optimizer": args.optimizer}
    args.config = Config(**{**asdict(config), **{k: v for k, v in overrides.items() if v is not None}})
    if args.quick:
        args.seeds = args.seeds or [0]
        args.codecs = args.codecs or QUICK_SPECS
    if args.fsdp:
        args.codecs = [s for s in (args.codecs or [spec for _, spec in SPECS]) if not s.startswith("powersgd")]
    for spec in args.codecs or []:
        check_spec(spec)
    return args


def build_plan(args) -> list[tuple]:
    """(family, spec, seed) in order: every spec's first seed before any spec's second."""
    family_of = {spec: family for family, spec in SPECS}
    specs = args.codecs or [spec for _, spec in SPECS]
    seeds_of = {s: args.seeds if args.seeds is not None else ([0, 1, 2] if s in SEEDED_SPECS else [0]) for s in specs}
    rounds = max(len(seeds) for seeds in seeds_of.values())
    return [(family_of.get(s, s.split(":")[0]), s, seeds_of[s][i]) for i in range(rounds) for s in specs
            if i < len(seeds_of[s])]


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "lm" + ("_fsdp" if args.fsdp else "") + ("_quick" if args.quick else ""))
    if args.replot:
        with open(stem + ".json") as f:
            report = json.load(f)
        plot(report["summary"], report["baselines"], report["world_size"], stem + ".png")
        print(f"redrew {stem}.png")
        return
    plan = build_plan(args)
    corpus = split_corpus(load_chapters(), args.config.vocab)  # under torchrun every rank's: the fit is deterministic
    baselines = ngram_baselines(corpus["train"], corpus["val"], corpus["vocab_size"])
    parameters = sum(p.numel() for p in Transformer(corpus["vocab_size"], args.config).parameters())
    raw_path = stem + ".runs.json"
    started = time.time()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        # the main job's rule: NCCL where every local rank has a GPU of its own (run_plan: cuda:LOCAL_RANK)
        backend = main_job.choose_backend(None, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), under_torchrun=True)
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        rank_main(rank, world, backend, plan, corpus, args, raw_path)
        if rank != 0:
            return
    else:
        world, backend = args.nprocs, "gloo"
        print(f"{len(plan)} runs on {world} ranks ({backend}); {parameters / 1e6:.2f}M parameters, "
              f"{len(corpus['train']) / 1e6:.2f}M training and {len(corpus['val']) / 1e6:.2f}M validation tokens; "
              f"baselines: unigram ppl {baselines['unigram_ppl']:.2f}, bigram ppl {baselines['bigram_ppl']:.2f}",
              flush=True)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(main_job.find_free_port())
        mp.spawn(main_job.finish_spawned_rank, args=(rank_main, world, backend, plan, corpus, args, raw_path),
                 nprocs=world, join=True)
    with open(raw_path) as f:
        runs = json.load(f)
    os.remove(raw_path)
    for run in runs:
        run["dataset"] = "kjv"  # merged_with_earlier's key
    runs = merged_with_earlier(stem + ".json", runs) if not args.fresh else runs
    rows = summarize(runs)
    config = asdict(args.config)
    report = {"machine": machine(), "world_size": world, "backend": backend, "seconds": time.time() - started,
              "model": {**config, "parameters": parameters},
              "corpus": {"source": f"Debian bible-kjv, bible -f {BIBLE_RANGE}", "train_chars": corpus["train_chars"],
                         "val_chars": corpus["val_chars"], "train_tokens": len(corpus["train"]),
                         "val_tokens": len(corpus["val"])},
              "baselines": baselines, "args": {k: v for k, v in vars(args).items() if k not in ("out", "config")},
              "summary": rows, "runs": runs}
    write_results(stem, report, rows)
    plot(rows, baselines, world, stem + ".png")
    print(f"\nbaselines on the validation split: unigram ppl {baselines['unigram_ppl']:.2f}, "
          f"bigram ppl {baselines['bigram_ppl']:.2f}")
    print(f"{'spec':32s} {'val perplexity':>22s} {'vs none':>8s} {'ratio':>8s} {'time':>6s}")
    for row in rows:
        print(f"{row['spec']:32s} {row['ppl_mean']:7.3f} ± {row['ppl_std']:5.3f} (n={row['seeds']}) "
              f"{row['ppl_vs_none_pct']:+7.2f}% {row['ratio']:7.1f}x {row['time_vs_none']:5.2f}x")
    print(f"wrote {stem}.json, .csv and .png in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
