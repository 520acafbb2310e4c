"""Train, export and evaluate the demo Mixture-of-Experts model.

The model is mlx-lm's own ``qwen3_moe`` (``mlx_lm.models.qwen3_moe.Model``),
so the exported checkpoint loads with ``mlx_lm.load`` like any Qwen3-MoE
checkpoint. Training is mixed precision: float32 master weights and Adam
moments (decoupled weight decay on matrices), a bfloat16 copy of the weights
for the forward and backward pass.
The loss is next-token cross-entropy plus Qwen3's load-balancing loss on the
router logits (see :func:`balance_loss`).

A run lives in one folder (``--out``). Training saves a checkpoint there
every ``--ckpt-every`` steps and when ``--time-limit-s`` is about to run out,
and a later call with the same ``--out`` resumes from it (weights, optimizer
state, step and data position), so training can be split over calls of a few
minutes each. The loss curve goes to ``log.jsonl`` and ``loss.png``.

Subcommands (``train`` is the default)::

    python training/train.py [train] --preset demo --out training/run --time-limit-s 520
    python training/train.py export   --out training/run    # bf16 + 4-bit mlx-lm folders
    python training/train.py evaluate --model training/run/model-4bit
    python training/train.py plot     --out training/run
    python training/train.py pack     --out training/run --dest $OUT  # 4-bit model in parts
    python training/train.py shape    --preset demo         # sizes, no training

``train`` exits with 0 when the run is done and with 3 when it stopped early
(time limit or ``--max-steps``) and must be run again to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.qwen3_moe import Model, ModelArgs

START_TIME = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from corpus import EVERYDAY_SOURCES  # noqa: E402
from tokenizer import EOS, IM_END, file_sha  # noqa: E402

DEFAULT_DATA = HERE / "data"
DEFAULT_TOKENIZER = HERE / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LN2 = math.log(2.0)
EXIT_PAUSED = 3  # train's exit status when it stopped before the end (resume it)
# Tokens per forward pass when evaluating an exported folder. On CUDA, MLX
# 0.32.4's quantized expert matmul (gather_qmm) failed with "cuGraphAddKernelNode
# ... invalid argument" at 8192 tokens x top-8 = 65536 rows; 4096 tokens work.
EVAL_BATCH_TOKENS = 4096
# Training batches up to this many tokens x top-k rows ran on an H100; twice
# as many failed in the bf16 gather_mm with the same CUDA graph error.
MAX_CUDA_ROUTED_ROWS = 262144


@dataclass
class Config:
    """Model shape and training settings of one run (saved in the run folder).

    Attributes:
        hidden_size: Model width.
        num_layers: Decoder layers, all of them MoE layers.
        num_experts: Routed experts per layer.
        top_k: Experts per token.
        moe_intermediate_size: Each expert's SwiGLU width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        head_dim: Width of one head.
        vocab_size: Token ids (the tokenizer's vocabulary).
        rope_theta: RoPE base.
        max_position_embeddings: Written to config.json (training uses seq_len).
        seq_len: Tokens per training sequence.
        batch_size: Sequences per step.
        total_tokens: Training length in tokens (steps = total / (batch*seq)).
        lr: Peak learning rate.
        min_lr_ratio: Final learning rate as a share of the peak (cosine).
        warmup_steps: Linear warm-up steps.
        weight_decay: Decoupled weight decay on matrices (not norms).
        grad_clip: Global gradient-norm clip.
        aux_loss_coef: Weight of the load-balancing loss.
        init_std: Standard deviation of the weight initialization.
        seed: Seed of the initialization and the data order.
        eval_every: Steps between validation runs.
        eval_tokens: Validation tokens per run (0: the whole split).
        ckpt_every: Steps between checkpoints.
        log_every: Steps between train-loss log records.
    """

    hidden_size: int = 256
    num_layers: int = 8
    num_experts: int = 64
    top_k: int = 8
    moe_intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    seq_len: int = 512
    batch_size: int = 64
    total_tokens: int = 134_217_728
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    init_std: float = 0.02
    seed: int = 0
    eval_every: int = 500
    eval_tokens: int = 0
    ckpt_every: int = 1000
    log_every: int = 20

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step."""
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return max(1, self.total_tokens // self.tokens_per_step)


PRESETS: Dict[str, Config] = {
    # A few seconds a step on a 2-core CPU: checks the whole pipeline.
    "smoke": Config(
        hidden_size=64,
        num_layers=2,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        seq_len=128,
        batch_size=8,
        total_tokens=40 * 8 * 128,
        lr=3e-3,
        warmup_steps=5,
        eval_every=20,
        eval_tokens=16384,
        ckpt_every=20,
        log_every=5,
    ),
    # The demo model: Qwen3-30B-A3B's routing (64 of its 128 experts, top-8)
    # at a width that trains to readable English in ~15 H100 minutes.
    "demo": Config(total_tokens=4096 * 64 * 512, eval_every=500, log_every=50),
}


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def model_config(cfg: Config, eos_ids: Optional[List[int]] = None) -> dict:
    """The mlx-lm / Hugging Face ``config.json`` of the model.

    Args:
        cfg: The run's configuration.
        eos_ids: End-of-sequence ids to record (``<|im_end|>``, ``<|endoftext|>``).

    Returns:
        A dict accepted by ``ModelArgs.from_dict`` and by mlx-lm's loader.
    """
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.moe_intermediate_size * cfg.top_k,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": True,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "torch_dtype": "bfloat16",
        "eos_token_id": eos_ids or [],
    }


class RouterRecorder(nn.Linear):
    """A router (``mlp.gate``) that also appends its logits to a list.

    It keeps the ``weight`` parameter at the same path, so checkpoints are
    those of the plain model.

    Args:
        gate: The router to replace (its weight is shared).
        sink: The list that receives the logits of every call.
    """

    def __init__(self, gate: nn.Linear, sink: list):
        out_dims, in_dims = gate.weight.shape
        super().__init__(in_dims, out_dims, bias=False)
        self.weight = gate.weight
        object.__setattr__(self, "_sink", sink)  # not a child or parameter

    def __call__(self, x: mx.array) -> mx.array:
        logits = super().__call__(x)
        self._sink.append(logits)
        return logits


def build_model(cfg: Config, record_router: bool = True) -> Tuple[Model, list]:
    """Build the qwen3_moe model with this run's initialization.

    Weights are normal(0, init_std); the two projections that write into the
    residual stream (``o_proj``, experts' ``down_proj``) are scaled down by
    ``sqrt(2 * num_layers)``; norms start at one.

    Args:
        cfg: The run's configuration.
        record_router: Wrap each router so its logits are recorded.

    Returns:
        (model in float32, list that receives each layer's router logits).
    """
    model = Model(ModelArgs.from_dict(model_config(cfg)))
    mx.random.seed(cfg.seed)
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_layers)

    def init(path: str, p: mx.array) -> mx.array:
        if p.ndim == 1:
            return mx.ones_like(p)
        std = cfg.init_std * (
            residual_scale if path.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        )
        return mx.random.normal(p.shape, scale=std)

    model.update(tree_unflatten([(k, init(k, v)) for k, v in tree_flatten(model.parameters())]))
    sink: list = []
    if record_router:
        for layer in model.model.layers:
            layer.mlp.gate = RouterRecorder(layer.mlp.gate, sink)
    mx.eval(model.parameters())
    return model, sink


def balance_loss(router_logits: mx.array, top_k: int) -> mx.array:
    """Switch-Transformer / Qwen3 load-balancing loss of one MoE layer.

    ``num_experts * sum_i f_i * P_i``, where ``f_i`` is the share of the
    layer's top-k assignments that went to expert i and ``P_i`` is the mean
    router probability of expert i over the tokens. It is 1 when routing is
    uniform and grows as it concentrates; the gradient flows through ``P``.

    Args:
        router_logits: (..., num_experts) logits of the router.
        top_k: Experts chosen per token.

    Returns:
        A scalar.
    """
    num_experts = router_logits.shape[-1]
    logits = router_logits.reshape(-1, num_experts).astype(mx.float32)
    probs = mx.softmax(logits, axis=-1)
    chosen = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]
    counts = mx.zeros((num_experts,), mx.float32).at[chosen.reshape(-1)].add(1.0)
    f = mx.stop_gradient(counts / chosen.size)
    p = probs.mean(axis=0)
    return num_experts * mx.sum(f * p)


def count_parameters(cfg: Config) -> dict:
    """Parameter counts of the model, from its shape alone.

    Args:
        cfg: The run's configuration.

    Returns:
        total, active (per token), experts, embedding and per-expert counts.
    """
    h, m, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * cfg.head_dim
    per_expert = 3 * h * m
    layer_dense = attn + h * e + 2 * h  # attention, router, two norms
    embed = cfg.vocab_size * h
    experts = cfg.num_layers * e * per_expert
    total = embed + h + cfg.num_layers * layer_dense + experts
    active = embed + h + cfg.num_layers * (layer_dense + k * per_expert)
    return {
        "total": total,
        "active": active,
        "experts": experts,
        "embedding": embed,
        "per_expert": per_expert,
    }


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


class TokenStream:
    """A split's token ids (``tokens-<split>.npy``) and their metadata.

    Training samples are windows of ``seq_len + 1`` tokens; each epoch visits
    every window once, in an order and with a start offset drawn from the seed
    and the epoch, so the position in the data is one integer (samples seen).

    Args:
        data_dir: The folder with the token files.
        split: ``train``, ``valid`` or ``test``.
    """

    def __init__(self, data_dir: Path, split: str):
        self.path = data_dir / f"tokens-{split}.npy"
        self.tokens = np.load(self.path, mmap_mode="r")
        self.meta = json.loads(self.path.with_suffix(".json").read_text())

    def window_count(self, seq_len: int) -> int:
        """Windows per epoch.

        Args:
            seq_len: Tokens per window (plus one target).

        Returns:
            The number of windows.
        """
        return (len(self.tokens) - 1) // seq_len - 1

    def batch(
        self, first_sample: int, batch_size: int, seq_len: int, seed: int
    ) -> Tuple[mx.array, mx.array]:
        """The training batch that starts at a given sample number.

        Args:
            first_sample: Samples seen before this batch.
            batch_size: Sequences in the batch.
            seq_len: Tokens per sequence.
            seed: The run's seed.

        Returns:
            (inputs, targets), both (batch_size, seq_len) int32.
        """
        n = self.window_count(seq_len)
        rows = []
        for i in range(first_sample, first_sample + batch_size):
            epoch, j = divmod(i, n)
            rng = np.random.default_rng([seed, epoch])
            order = rng.permutation(n)
            shift = int(rng.integers(seq_len))
            start = shift + int(order[j]) * seq_len
            rows.append(np.asarray(self.tokens[start : start + seq_len + 1], dtype=np.int32))
        arr = np.stack(rows)
        return mx.array(arr[:, :-1]), mx.array(arr[:, 1:])


def token_nll(forward, tokens: np.ndarray, seq_len: int, batch_size: int) -> np.ndarray:
    """Per-token negative log-likelihood (nats) of a token stream.

    The stream is cut into consecutive windows of ``seq_len`` predicted
    tokens, each conditioned on the tokens before it in its window; every
    token but the first is predicted once.

    Args:
        forward: Maps (B, L) int32 ids to (B, L, vocab) logits (a model).
        tokens: The token stream.
        seq_len: Window length.
        batch_size: Windows per forward pass.

    Returns:
        float32 array of len(tokens); entry 0 is 0 (not predicted).
    """
    n = len(tokens)
    out = np.zeros(n, dtype=np.float32)
    starts = range(0, n - 1, seq_len)
    full = [s for s in starts if s + seq_len < n]
    batches = [(full[b : b + batch_size], seq_len) for b in range(0, len(full), batch_size)]
    batches += [([s], n - 1 - s) for s in starts if s + seq_len >= n]  # the short tail
    for group, length in batches:
        x = np.stack([np.asarray(tokens[s : s + length], dtype=np.int32) for s in group])
        y = np.stack([np.asarray(tokens[s + 1 : s + 1 + length], dtype=np.int32) for s in group])
        logits = forward(mx.array(x)).astype(mx.float32)
        nll = np.array(nn.losses.cross_entropy(logits, mx.array(y), reduction="none"))
        for row, s in zip(nll, group):
            out[s + 1 : s + 1 + length] = row
    return out


def bpc_report(nll: np.ndarray, meta: dict, limit_tokens: int = 0) -> dict:
    """Bits per character overall, on everyday English, and per source.

    A document's bits are the sum of its tokens' nats (its closing
    ``<|endoftext|>`` included) over ln 2; it is divided by the document's
    characters.

    Args:
        nll: Per-token nats from :func:`token_nll` (possibly a prefix).
        meta: The split's metadata (``tokens-<split>.json``).
        limit_tokens: Count only whole documents within this many tokens
            (0: all documents covered by ``nll``).

    Returns:
        {"loss": nats/token, "bpc": ..., "everyday_bpc": ..., "sources": {...}}.
    """
    docs = meta["documents"]
    limit = min(len(nll), limit_tokens or len(nll))
    nats: Dict[str, float] = {}
    chars: Dict[str, int] = {}
    toks = 0
    for source, start, count, n_chars in zip(
        docs["source"], docs["start"], docs["tokens"], docs["chars"]
    ):
        if start + count > limit:
            continue
        nats[source] = nats.get(source, 0.0) + float(nll[start : start + count].sum())
        chars[source] = chars.get(source, 0) + n_chars
        toks += count

    def bpc(names) -> float:
        c = sum(chars.get(s, 0) for s in names)
        return sum(nats.get(s, 0.0) for s in names) / max(c, 1) / LN2

    return {
        "loss": sum(nats.values()) / max(toks, 1),
        "bpc": bpc(nats),
        "everyday_bpc": bpc(EVERYDAY_SOURCES),
        "tokens": toks,
        "chars": sum(chars.values()),
        "sources": {s: round(bpc([s]), 4) for s in sorted(nats)},
    }


# --------------------------------------------------------------------------
# Checkpoints and logs
# --------------------------------------------------------------------------


def save_checkpoint(
    out: Path,
    step: int,
    master: dict,
    optimizer: optim.Optimizer,
    cfg: Config,
    train_seconds: float,
) -> float:
    """Write a checkpoint folder and move the ``latest`` pointer to it.

    The folder is written under a temporary name and renamed, and the pointer
    is replaced atomically, so a run stopped at any moment resumes from the
    previous or the new checkpoint, never from half of one. Older checkpoints
    are removed afterwards.

    Args:
        out: The run folder.
        step: Optimizer steps done.
        master: float32 weights.
        optimizer: The optimizer (its state is saved).
        cfg: The run's configuration.
        train_seconds: Training time so far (all calls).

    Returns:
        Seconds the save took.
    """
    t0 = time.monotonic()
    name = f"ckpt-{step:07d}"
    tmp = out / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(master)))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    state = {
        "step": step,
        "samples_seen": step * cfg.batch_size,
        "train_seconds": train_seconds,
        "config": dataclasses.asdict(cfg),
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    shutil.rmtree(out / name, ignore_errors=True)
    os.replace(tmp, out / name)
    pointer = out / "latest.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, out / "latest")
    for old in out.glob("ckpt-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return time.monotonic() - t0


def save_snapshot(path: Path, step: int, master: dict, valid_loss: float) -> None:
    """Replace a weights-only snapshot (``best``) atomically.

    Args:
        path: The snapshot folder.
        step: The step of the weights.
        master: float32 weights.
        valid_loss: Their validation loss.
    """
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(master)))
    (tmp / "state.json").write_text(json.dumps({"step": step, "valid_loss": valid_loss}) + "\n")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def best_loss(out: Path) -> float:
    """The validation loss of the run's best snapshot (inf if none).

    Args:
        out: The run folder.

    Returns:
        The loss.
    """
    state = out / "best" / "state.json"
    return json.loads(state.read_text())["valid_loss"] if state.exists() else float("inf")


def latest_checkpoint(out: Path) -> Optional[Path]:
    """The folder the ``latest`` pointer names, if any.

    Args:
        out: The run folder.

    Returns:
        The checkpoint folder, or None for a new run.
    """
    pointer = out / "latest"
    if not pointer.exists():
        return None
    return out / pointer.read_text().strip()


def load_weights(ckpt: Path) -> dict:
    """The float32 weights of a checkpoint, as a parameter tree.

    Args:
        ckpt: A checkpoint folder.

    Returns:
        The nested parameter dict.
    """
    return tree_unflatten(list(mx.load(str(ckpt / "weights.safetensors")).items()))


class Log:
    """The run's JSONL log (one record per line, flushed at once).

    Args:
        path: The ``log.jsonl`` file.
        resume_step: Records of later steps (written after the checkpoint
            being resumed) are dropped.
    """

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        if path.exists():  # drop records newer than the checkpoint resumed from
            keep = [
                ln
                for ln in path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= resume_step
            ]
            path.write_text("".join(ln + "\n" for ln in keep))
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record.

        Args:
            record: JSON-serializable dict; ``step`` is required.
        """
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def plot_log(out: Path) -> Optional[Path]:
    """Draw the loss curves of ``log.jsonl`` into ``loss.png``.

    Args:
        out: The run folder.

    Returns:
        The PNG's path, or None when matplotlib is missing or there is no log.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (run `train.py plot` elsewhere)")
        return None
    path = out / "log.jsonl"
    if not path.exists():
        return None
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    train = [r for r in records if "train_loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    def mtok(rs: List[dict]) -> List[float]:
        return [r["tokens"] / 1e6 for r in rs]

    axes[0].plot(mtok(train), [r["train_loss"] for r in train], label="train", lw=0.8)
    axes[0].plot(mtok(valid), [r["valid_loss"] for r in valid], "o-", label="valid")
    axes[0].set(xlabel="tokens (M)", ylabel="cross-entropy (nats/token)", title="loss")
    axes[1].plot(mtok(valid), [r["valid_bpc"] for r in valid], "o-", label="valid, all")
    axes[1].plot(
        mtok(valid), [r["everyday_bpc"] for r in valid], "s-", label="valid, everyday English"
    )
    axes[1].axhline(2.5, color="gray", ls="--", lw=0.8)
    axes[1].set(xlabel="tokens (M)", ylabel="bits per character", title="valid bpc")
    axes[2].plot(mtok(train), [r["aux_loss"] for r in train], lw=0.8)
    axes[2].set(
        xlabel="tokens (M)",
        ylabel="num_experts * sum f_i P_i (1 = balanced)",
        title="load-balancing loss",
    )
    for ax in axes[:2]:
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = out / "loss.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def make_optimizer(cfg: Config) -> optim.Optimizer:
    """Adam with linear warm-up and cosine decay (weight decay is applied
    separately, to matrices only, in the train step).

    Args:
        cfg: The run's configuration.

    Returns:
        The optimizer.
    """
    warmup = min(cfg.warmup_steps, cfg.total_steps - 1)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr / max(warmup, 1), cfg.lr, max(warmup, 1)),
            optim.cosine_decay(
                cfg.lr, max(cfg.total_steps - warmup, 1), end=cfg.lr * cfg.min_lr_ratio
            ),
        ],
        [warmup],
    )
    return optim.Adam(learning_rate=schedule, betas=[0.9, 0.95], eps=1e-8)


def compute_dtype(name: str) -> mx.Dtype:
    """The dtype of the forward/backward pass.

    Args:
        name: ``auto``, ``bfloat16`` or ``float32``; ``auto`` is bfloat16 on
            a GPU and float32 on the CPU, where MLX's ``gather_mm`` (the
            experts' matmul) supports float32 only.

    Returns:
        The dtype.
    """
    if name == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return mx.bfloat16 if name == "bfloat16" else mx.float32


def run_config(args: argparse.Namespace) -> Config:
    """The preset with the command line's overrides applied.

    Args:
        args: Parsed arguments (``preset`` and optional field overrides).

    Returns:
        The configuration.
    """
    cfg = dataclasses.replace(PRESETS[args.preset])
    for field in dataclasses.fields(Config):
        value = getattr(args, field.name, None)
        if value is not None:
            setattr(cfg, field.name, value)
    return cfg


def train(args: argparse.Namespace) -> int:
    """Train (or resume) a run until it is done or the time limit is near.

    Args:
        args: Parsed ``train`` arguments.

    Returns:
        The exit status: 0 when the run is done, ``EXIT_PAUSED`` when it
        stopped for the time limit or ``--max-steps`` (run again to resume).
    """
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        state = json.loads((ckpt / "state.json").read_text())
        cfg = Config(**state["config"])
        step, train_seconds = state["step"], state["train_seconds"]
        print(
            f"resuming {out} from step {step}/{cfg.total_steps} "
            f"({ckpt.name}; preset and overrides of this call are ignored)"
        )
    else:
        cfg, step, train_seconds = run_config(args), 0, 0.0
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    train_data = TokenStream(args.data, "train")
    valid_data = TokenStream(args.data, "valid")
    if train_data.meta["vocab_size"] > cfg.vocab_size:
        raise SystemExit(
            f"tokenizer has {train_data.meta['vocab_size']} ids, model only {cfg.vocab_size}"
        )
    rows = cfg.tokens_per_step * cfg.top_k
    if mx.default_device() == mx.gpu and rows > MAX_CUDA_ROUTED_ROWS:
        print(
            f"warning: {rows} routed rows per step (batch x seq_len x top_k) is more than "
            f"{MAX_CUDA_ROUTED_ROWS}, the most seen working with MLX's CUDA gather_mm"
        )
    counts = count_parameters(cfg)
    print(
        f"model: {counts['total'] / 1e6:.1f}M parameters ({counts['active'] / 1e6:.1f}M "
        f"active), {cfg.num_layers} layers x {cfg.num_experts} experts top-{cfg.top_k}; "
        f"{cfg.total_steps} steps of {cfg.tokens_per_step} tokens; "
        f"device {mx.default_device()}",
        flush=True,
    )

    model, sink = build_model(cfg)
    master = tree_map(lambda p: p.astype(mx.float32), model.trainable_parameters())
    optimizer = make_optimizer(cfg)
    if ckpt is not None:
        master = load_weights(ckpt)
        optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    dtype = compute_dtype(args.dtype)
    print(f"compute dtype: {dtype}", flush=True)
    model.update(tree_map(lambda p: p.astype(dtype), master))
    holder = {"params": master}

    def loss_fn(params, x, y):
        model.update(tree_map(lambda p: p.astype(dtype), params))
        sink.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
        aux = mx.mean(mx.stack([balance_loss(g, cfg.top_k) for g in sink]))
        sink.clear()
        return ce + cfg.aux_loss_coef * aux, ce, aux

    value_and_grad = mx.value_and_grad(loss_fn)

    def step_fn(x, y):
        params = holder["params"]
        (_, ce, aux), grads = value_and_grad(params, x, y)
        grads, grad_norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        new = optimizer.apply_gradients(grads, params)
        decay = optimizer.learning_rate * cfg.weight_decay
        holder["params"] = tree_map(lambda n, p: n - decay * p if p.ndim >= 2 else n, new, params)
        return ce, aux, grad_norm

    if not args.no_compile:
        state = [model.state, optimizer.state, holder]
        step_fn = mx.compile(step_fn, inputs=state, outputs=state)

    def forward(x: mx.array) -> mx.array:
        logits = model(x)
        sink.clear()
        return logits

    def evaluate_now() -> dict:
        model.update(tree_map(lambda p: p.astype(dtype), holder["params"]))
        limit = cfg.eval_tokens or len(valid_data.tokens)
        nll = token_nll(forward, valid_data.tokens[:limit], cfg.seq_len, cfg.batch_size)
        return bpc_report(nll, valid_data.meta, limit)

    log = Log(out / "log.jsonl", step)
    limit = args.time_limit_s
    # first guesses, replaced by measurements (an evaluation's first run compiles)
    ckpt_cost, eval_cost, step_cost = 10.0, 30.0, 0.0
    window: List[Tuple[float, float, float]] = []
    t_window = time.monotonic()
    steps_this_call = 0
    status = "done"
    while step < cfg.total_steps:
        elapsed = time.monotonic() - START_TIME
        evaluates = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.total_steps
        needed = 2 * step_cost + ckpt_cost + 10 + (eval_cost if evaluates else 0)
        if limit and elapsed + needed > limit:
            status = "paused"
            break
        if args.max_steps and steps_this_call >= args.max_steps:
            status = "paused"
            break
        t0 = time.monotonic()
        x, y = train_data.batch(step * cfg.batch_size, cfg.batch_size, cfg.seq_len, cfg.seed)
        ce, aux, grad_norm = step_fn(x, y)
        mx.eval(ce, aux, grad_norm, holder["params"], optimizer.state)
        step += 1
        steps_this_call += 1
        dt = time.monotonic() - t0
        train_seconds += dt
        step_cost = dt if steps_this_call > 1 else step_cost
        window.append((ce.item(), aux.item(), grad_norm.item()))
        if step % cfg.log_every == 0 or step == cfg.total_steps:
            span = time.monotonic() - t_window
            mean = np.mean(window, axis=0)
            rec = {
                "step": step,
                "tokens": step * cfg.tokens_per_step,
                "train_loss": round(float(mean[0]), 4),
                "aux_loss": round(float(mean[1]), 4),
                "grad_norm": round(float(mean[2]), 4),
                "lr": float(optimizer.learning_rate.item()),
                "tok_per_s": round(len(window) * cfg.tokens_per_step / span),
                "train_seconds": round(train_seconds, 1),
            }
            log.write(rec)
            print(
                f"step {step}/{cfg.total_steps} loss {rec['train_loss']:.3f} "
                f"aux {rec['aux_loss']:.3f} lr {rec['lr']:.2e} {rec['tok_per_s']} tok/s",
                flush=True,
            )
            window, t_window = [], time.monotonic()
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            t1 = time.monotonic()
            rep = evaluate_now()
            log.write(
                {
                    "step": step,
                    "tokens": step * cfg.tokens_per_step,
                    "valid_loss": round(rep["loss"], 4),
                    "valid_bpc": round(rep["bpc"], 4),
                    "everyday_bpc": round(rep["everyday_bpc"], 4),
                    "sources": rep["sources"],
                }
            )
            if rep["loss"] < best_loss(out):
                save_snapshot(out / "best", step, holder["params"], rep["loss"])
            eval_cost = time.monotonic() - t1
            print(
                f"  valid loss {rep['loss']:.3f} bpc {rep['bpc']:.3f} everyday "
                f"{rep['everyday_bpc']:.3f} ({eval_cost:.1f} s)",
                flush=True,
            )
            t_window = time.monotonic()
        if step % cfg.ckpt_every == 0 and step < cfg.total_steps:
            ckpt_cost = save_checkpoint(out, step, holder["params"], optimizer, cfg, train_seconds)
            t_window = time.monotonic()
    if steps_this_call or latest_checkpoint(out) is None:
        ckpt_cost = save_checkpoint(out, step, holder["params"], optimizer, cfg, train_seconds)
    png = plot_log(out)
    if png:
        print(f"plot: {png}")
    if status == "done":
        print(
            f"status: done at step {step}/{cfg.total_steps} "
            f"({train_seconds:.0f} s of training); next: train.py export --out {out}"
        )
    else:
        print(
            f"status: paused at step {step}/{cfg.total_steps} "
            f"(checkpoint saved in {ckpt_cost:.1f} s); run the same command again to resume"
        )
        return EXIT_PAUSED
    return 0


# --------------------------------------------------------------------------
# Export and evaluation
# --------------------------------------------------------------------------


def folder_size(path: Path) -> int:
    """Bytes of the ``.safetensors`` files in a folder.

    Args:
        path: A model folder.

    Returns:
        Their total size.
    """
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def plain_model(cfg: Config, weights: dict, eos_ids: List[int]) -> Tuple[Model, dict]:
    """A plain mlx-lm model (no recorders) holding the given weights in bf16.

    Args:
        cfg: The run's configuration.
        weights: Parameter tree (float32).
        eos_ids: End-of-sequence ids for config.json.

    Returns:
        (model, config dict).
    """
    config = model_config(cfg, eos_ids)
    model = Model(ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), weights))
    mx.eval(model.parameters())
    return model, config


def copy_tokenizer(tokenizer_dir: Path, dest: Path) -> None:
    """Copy the tokenizer files into a model folder.

    Args:
        tokenizer_dir: The tokenizer folder.
        dest: The model folder.
    """
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, dest / name)


def eos_token_ids(tokenizer_dir: Path) -> List[int]:
    """Ids of ``<|im_end|>`` and ``<|endoftext|>`` in the tokenizer.

    Args:
        tokenizer_dir: The tokenizer folder.

    Returns:
        The two ids, end of turn first.
    """
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    return [ids[IM_END], ids[EOS]]


def sample_reply(model_dir: Path, prompt: str, max_tokens: int = 60) -> str:
    """Load a model folder with ``mlx_lm.load`` and answer one chat prompt.

    Args:
        model_dir: The model folder.
        prompt: The user's message.
        max_tokens: Generation limit.

    Returns:
        The generated reply (on the CPU, computed in float32 as in
        :func:`evaluate_folder`).
    """
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    mx.random.seed(0)
    return generate(
        model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(temp=0.7, top_p=0.9)
    )


def export(args: argparse.Namespace) -> int:
    """Write ``model-bf16`` and ``model-4bit`` mlx-lm folders and test them.

    The weights come from the best-validation snapshot (``--weights best``,
    the default when the run has one) or the last checkpoint. The 4-bit model
    is quantized by mlx-lm's ``quantize_model`` (group size 64, the
    qwen3_moe default predicate: routers at 8 bits). Both folders get the
    tokenizer and are written before any test; then each is loaded with
    ``mlx_lm.load``, answers one chat prompt and is evaluated on the valid
    split. A failed test is reported and does not undo the export.

    Args:
        args: Parsed ``export`` arguments.

    Returns:
        The exit status: 0; 1 when a test failed; 2 when the run is not
        finished (and ``--allow-unfinished`` was not given).
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    ckpt = latest_checkpoint(args.out)
    if ckpt is None:
        raise SystemExit(f"no checkpoint in {args.out}")
    state = json.loads((ckpt / "state.json").read_text())
    cfg = Config(**state["config"])
    if state["step"] < cfg.total_steps:
        if not args.allow_unfinished:
            print(
                f"the run is at step {state['step']}/{cfg.total_steps}: resume training "
                f"first (or pass --allow-unfinished)"
            )
            return 2
        print(f"warning: exporting an unfinished run (step {state['step']}/{cfg.total_steps})")
    meta = json.loads((args.data / "tokens-valid.json").read_text())
    if meta["tokenizer_sha"] != file_sha(args.tokenizer / "tokenizer.json"):
        raise SystemExit(f"{args.tokenizer} is not the tokenizer that encoded {args.data}")
    use_best = args.weights == "best" and (args.out / "best").exists()
    source = args.out / "best" if use_best else ckpt
    source_state = json.loads((source / "state.json").read_text())
    print(f"exporting the weights of step {source_state['step']} ({source.name})")
    weights = load_weights(source)
    eos_ids = eos_token_ids(args.tokenizer)
    folders = []
    for name, bits in (("model-bf16", None), ("model-4bit", 4)):
        dest = args.out / name
        shutil.rmtree(dest, ignore_errors=True)
        model, config = plain_model(cfg, weights, eos_ids)
        if bits:
            model, config = quantize_model(model, config, group_size=64, bits=bits)
        save_model(dest, model)
        save_config(config, dest / "config.json")
        copy_tokenizer(args.tokenizer, dest)
        folders.append(dest)
        print(f"{dest}: {folder_size(dest) / 1e6:.2f} MB of weights", flush=True)
    results, status = {"step": source_state["step"]}, 0
    for dest in folders:
        try:
            reply = sample_reply(dest, args.prompt)
            rep = evaluate_folder(dest, args.data, "valid", cfg.seq_len, cfg.eval_tokens)
        except Exception as exc:  # noqa: BLE001 - report, keep the folders, test the next one
            print(f"{dest.name}: test failed: {exc!r}", flush=True)
            results[dest.name] = {"bytes": folder_size(dest), "error": repr(exc)}
            status = 1
            continue
        results[dest.name] = {"bytes": folder_size(dest), **rep, "sample": reply}
        print(
            f"{dest.name}: valid bpc {rep['bpc']:.3f}, everyday {rep['everyday_bpc']:.3f}\n"
            f"  {args.prompt!r} -> {reply!r}",
            flush=True,
        )
    (args.out / "export.json").write_text(json.dumps(results, indent=2) + "\n")
    return status


PACK_PART_BYTES = 15 * 2**20  # the device tool brings back files of at most 16 MiB


def pack(args: argparse.Namespace) -> int:
    """The ``pack`` subcommand: the 4-bit model and the run's record as a
    tar archive cut into parts small enough to bring back from the GPU
    machine.

    The archive holds ``model-4bit/``, ``log.jsonl``, ``loss.png``,
    ``export.json`` and ``config.json`` of the run folder. Unpack with
    ``cat PREFIX.part-* | tar -x``.

    Args:
        args: Parsed ``pack`` arguments (``out``, ``dest``, ``prefix``).

    Returns:
        The exit status.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("model-4bit", "log.jsonl", "loss.png", "export.json", "config.json"):
            if (args.out / name).exists():
                tar.add(args.out / name, arcname=name)
    data = buf.getvalue()
    args.dest.mkdir(parents=True, exist_ok=True)
    parts = [data[i : i + PACK_PART_BYTES] for i in range(0, len(data), PACK_PART_BYTES)]
    for i, part in enumerate(parts):
        (args.dest / f"{args.prefix}.part-{i:02d}").write_bytes(part)
    print(f"{len(data) / 1e6:.1f} MB in {len(parts)} parts: {args.dest}/{args.prefix}.part-*")
    return 0


def evaluate_folder(
    model_dir: Path, data_dir: Path, split: str, seq_len: int, limit_tokens: int = 0
) -> dict:
    """Bits per character of an mlx-lm model folder on a split.

    On the CPU the weights are cast to float32 first (MLX's CPU ``gather_mm``
    supports float32 only; quantized experts are unaffected).

    Args:
        model_dir: The model folder (bf16 or quantized).
        data_dir: The folder with ``tokens-<split>.npy``.
        split: ``valid`` or ``test``.
        seq_len: Evaluation window.
        limit_tokens: Evaluate only the documents within the first this many
            tokens (0: all).

    Returns:
        The :func:`bpc_report` dict; also written to ``eval-<split>.json``.
    """
    from mlx_lm import load

    model, _ = load(str(model_dir))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    stream = TokenStream(data_dir, split)
    tokens = stream.tokens[:limit_tokens] if limit_tokens else stream.tokens
    nll = token_nll(model, tokens, seq_len, max(1, EVAL_BATCH_TOKENS // seq_len))
    rep = bpc_report(nll, stream.meta)
    (model_dir / f"eval-{split}.json").write_text(json.dumps(rep, indent=2) + "\n")
    return rep


def evaluate(args: argparse.Namespace) -> int:
    """The ``evaluate`` subcommand: print bits per character of a model folder.

    Args:
        args: Parsed ``evaluate`` arguments.

    Returns:
        The exit status.
    """
    rep = evaluate_folder(args.model, args.data, args.split, args.seq_len, args.eval_tokens)
    print(json.dumps(rep, indent=2))
    return 0


def shape(args: argparse.Namespace) -> int:
    """The ``shape`` subcommand: parameters and checkpoint sizes of a preset.

    Builds the model, quantizes it as ``export`` does, and reports the bytes
    of the bf16 and 4-bit weights and of one 4-bit expert.

    Args:
        args: Parsed ``shape`` arguments.

    Returns:
        The exit status.
    """
    from mlx_lm.utils import quantize_model

    cfg = run_config(args)
    counts = count_parameters(cfg)
    model, config = plain_model(cfg, build_model(cfg, record_router=False)[0].parameters(), [])
    bf16 = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    model, _ = quantize_model(model, config, group_size=64, bits=4)
    q4 = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    mlp = model.model.layers[0].mlp.switch_mlp
    expert = sum(v.nbytes for _, v in tree_flatten(mlp.parameters())) // cfg.num_experts
    report = {
        "parameters": counts,
        "bf16_bytes": bf16,
        "q4_bytes": q4,
        "q4_expert_bytes": expert,
        "q4_all_experts_bytes": expert * cfg.num_experts * cfg.num_layers,
        "train_tokens": cfg.total_steps * cfg.tokens_per_step,
    }
    print(json.dumps(report, indent=2))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``); without a subcommand
            ``train`` is meant.

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "export", "evaluate", "plot", "shape", "pack")
    if not argv or argv[0] not in commands + ("-h", "--help"):
        argv.insert(0, "train")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, data: bool = True, out: bool = True) -> None:
        if data:
            sp.add_argument(
                "--data",
                type=Path,
                default=DEFAULT_DATA,
                help="folder with tokens-*.npy (tokenizer.py encode)",
            )
        if out:
            sp.add_argument("--out", type=Path, default=HERE / "run", help="run folder")

    def overrides(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--preset", choices=sorted(PRESETS), default="demo")
        for field in dataclasses.fields(Config):
            sp.add_argument(
                "--" + field.name.replace("_", "-"),
                dest=field.name,
                type=type(field.default),
                default=None,
                help=f"override the preset's {field.name}",
            )

    sp = sub.add_parser("train", help="train or resume a run")
    common(sp)
    overrides(sp)
    sp.add_argument(
        "--time-limit-s",
        type=float,
        default=0,
        help="checkpoint and stop before this many seconds since start",
    )
    sp.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    sp.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="compute dtype (master weights are float32); auto: bfloat16 on a "
        "GPU, float32 on the CPU (MLX's CPU gather_mm is float32 only)",
    )
    sp.add_argument("--no-compile", action="store_true", help="do not mx.compile the step")
    sp = sub.add_parser("export", help="write and test bf16 and 4-bit mlx-lm folders")
    common(sp)
    sp.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    sp.add_argument("--prompt", default="Tell me something wise.")
    sp.add_argument(
        "--allow-unfinished",
        action="store_true",
        help="export a run whose training has not reached its last step",
    )
    sp.add_argument(
        "--weights",
        choices=["best", "last"],
        default="best",
        help="the best-validation snapshot (if the run has one) or the last checkpoint",
    )
    sp = sub.add_parser("evaluate", help="bits per character of a model folder")
    common(sp, out=False)
    sp.add_argument("--model", type=Path, required=True)
    sp.add_argument("--split", default="valid", choices=["valid", "test"])
    sp.add_argument("--seq-len", type=int, default=512)
    sp.add_argument(
        "--eval-tokens",
        type=int,
        default=0,
        help="evaluate the documents within this many tokens (0: all)",
    )
    sp = sub.add_parser("plot", help="draw loss.png from log.jsonl")
    common(sp, data=False)
    sp = sub.add_parser("shape", help="parameter counts and checkpoint sizes")
    overrides(sp)
    sp = sub.add_parser("pack", help="tar the 4-bit model and the run's record in parts")
    common(sp, data=False)
    sp.add_argument("--dest", type=Path, required=True, help="folder for the parts")
    sp.add_argument("--prefix", default="demo-model")
    args = p.parse_args(argv)
    if args.command == "train":
        return train(args)
    if args.command == "export":
        return export(args)
    if args.command == "evaluate":
        return evaluate(args)
    if args.command == "plot":
        print(plot_log(args.out))
        return 0
    if args.command == "pack":
        return pack(args)
    return shape(args)


if __name__ == "__main__":
    sys.exit(main())
