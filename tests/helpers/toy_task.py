"""A small, real task that exercises the whole training machinery on a frozen Llama target.

It stands in for the ConFu objective in tests and smoke runs: the frozen target ('tiny' preset,
random weights from a seed) produces EAGLE-3 feature taps; the trainable part is an ``fc``
projection of those taps plus one residual MLP head per "TTT step" s, read out through the
target's frozen (tied) embedding, and head s at position j predicts token x[j+1+s]. The loss is
the EAGLE-3-weighted (0.8^s) cross-entropy on loss-masked tokens, with uniform noise on the
features (EAGLE's feature augmentation) so that the run's RNG matters for exact resumption.

Data: an in-memory deterministic stream of affine sequences x[t+1] = (a·x[t] + c) mod V, one
(a, c, x0) per row, generated from (seed, batch index) — any batch can be regenerated from the
position alone, which is all the iterator state holds.
"""

from __future__ import annotations

import ml_collections
import numpy as np

import jax
import jax.numpy as jnp

from confu_jax import sharding as shd
from confu_jax.models.llama import Llama, init_params as llama_init, param_shapes
from confu_jax.models.presets import get_preset
from confu_jax.train.config import default_train_config
from confu_jax.train.acceptance import chain_acceptance_length
from confu_jax.train.streams import PositionStream
from confu_jax.train.task import TrainTask


def get_toy_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"
    c.model.seed = 1234  # the frozen target's random weights
    c.train = default_train_config()
    c.train.task = "tests.helpers.toy_task:build_task"
    c.train.steps = 20
    c.train.optim.lr = 3e-3
    c.train.optim.warmup_steps = 2
    c.train.checkpoint.every = 5
    c.train.log_every = 1
    c.train.eval_every = 10
    c.toy = ml_collections.ConfigDict()
    c.toy.global_batch_size = 8
    c.toy.seq_len = 16
    c.toy.ttt_steps = 3
    c.toy.head_dim = 96  # hidden width of each step's residual MLP
    c.toy.prompt_len = 4  # leading tokens masked out of the loss (like a prompt)
    c.toy.feature_noise = 0.05
    c.toy.data_seed = 7
    c.toy.eval_batches = 2
    return c


class AffineSequences(PositionStream):
    """Deterministic batch stream; state = number of global batches consumed."""

    seed_setting = "toy.data_seed"

    def __init__(self, global_batch: int, seq_len: int, vocab: int, prompt_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if global_batch % process_count:
            raise ValueError(f"toy.global_batch_size={global_batch} is not divisible by "
                             f"{process_count} processes")
        self.global_batch, self.seq_len, self.vocab = global_batch, seq_len, vocab
        self.prompt_len, self.seed = prompt_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.position = 0

    def batch_at(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        b, t, v = self.global_batch, self.seq_len, self.vocab
        a = rng.integers(1, 8, size=b)
        c = rng.integers(0, v, size=b)
        x = np.empty((b, t), np.int64)
        x[:, 0] = rng.integers(0, v, size=b)
        for i in range(1, t):
            x[:, i] = (a * x[:, i - 1] + c) % v
        mask = np.zeros((b, t), bool)
        mask[:, self.prompt_len:] = True
        return {"tokens": x[self.rows].astype(np.int32), "loss_mask": mask[self.rows]}


def init_head(rng, d: int, n_taps: int, steps: int, hidden: int) -> dict:
    k1, k2, k3 = jax.random.split(rng, 3)
    return {
        "fc": {"kernel": jax.random.normal(k1, (n_taps * d, d)) * (n_taps * d) ** -0.5},
        "heads": {
            "up": {"kernel": jax.random.normal(k2, (steps, d, hidden)) * d ** -0.5},
            "down": {"kernel": jax.random.normal(k3, (steps, hidden, d)) * 0.02},
        },
        "norm": {"scale": jnp.ones((d,))},
    }


def make_forward(model: Llama, taps: tuple, steps: int, noise: float):
    def per_step_logits(trainable, frozen, batch, rng, train: bool):
        tokens = batch["tokens"]
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        out = model.apply({"params": frozen}, tokens, pos, tap_layers=taps, return_logits=False)
        h_cat = jax.lax.stop_gradient(out.taps_btc)
        if train and noise > 0:
            h_cat = h_cat + jax.random.uniform(rng, h_cat.shape, minval=-noise, maxval=noise)
        g = shd.constrain(h_cat @ trainable["fc"]["kernel"], ("batch", None, None))  # [B,T,D]
        emb = jax.lax.stop_gradient(frozen["embed"]["embedding"])  # [V,D]
        logits = []
        for s in range(steps):
            up = trainable["heads"]["up"]["kernel"][s]
            down = trainable["heads"]["down"]["kernel"][s]
            h = shd.constrain(g + jax.nn.silu(g @ up) @ down, ("batch", None, None))
            h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * trainable["norm"]["scale"]
            logits.append(h @ emb.T)
        return jnp.stack(logits)  # [S,B,T,V]

    def targets(batch):
        tokens, mask = batch["tokens"], batch["loss_mask"]
        b, t = tokens.shape
        tgt, valid = [], []
        for s in range(steps):
            shift = 1 + s
            tg = jnp.concatenate([tokens[:, shift:], jnp.zeros((b, shift), tokens.dtype)], 1)
            mk = jnp.concatenate([mask[:, shift:], jnp.zeros((b, shift), bool)], 1)
            tgt.append(tg)
            valid.append(mk)
        return jnp.stack(tgt), jnp.stack(valid)  # [S,B,T]

    def loss_and_logits(trainable, frozen, batch, rng, train):
        logits = per_step_logits(trainable, frozen, batch, rng, train)
        tgt, valid = targets(batch)
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0]  # [S,B,T]
        w = valid.astype(jnp.float32)
        count = jnp.maximum(w.sum(axis=(1, 2)), 1.0)
        per_step = (nll * w).sum(axis=(1, 2)) / count
        acc = ((jnp.argmax(logits, -1) == tgt) * w).sum(axis=(1, 2)) / count
        loss = jnp.sum(per_step * 0.8 ** jnp.arange(steps))
        metrics = {}
        for s in range(steps):
            metrics[f"loss/step{s}"] = per_step[s]
            metrics[f"acc/step{s}"] = acc[s]
        return loss, metrics, logits, tgt, valid

    def loss_fn(trainable, frozen, batch, rng):
        loss, metrics, *_ = loss_and_logits(trainable, frozen, batch, rng, True)
        return loss, metrics

    def eval_fn(trainable, frozen, batch, rng):
        loss, metrics, logits, tgt, valid = loss_and_logits(trainable, frozen, batch, rng, False)
        metrics = dict(metrics, loss=loss)
        metrics["acceptance_length"] = chain_acceptance_length(jnp.argmax(logits, -1) == tgt, valid)
        return metrics

    return loss_fn, eval_fn


def build_task(config) -> TrainTask:
    cfg = get_preset(config.model.preset)
    toy = config.toy
    model = Llama(cfg)
    taps = cfg.default_taps
    loss_fn, eval_fn = make_forward(model, taps, toy.ttt_steps, toy.feature_noise)
    frozen_seed = int(config.model.seed)

    def load_frozen(shardings):
        # Random target weights built directly on their shardings (a real task loads files and
        # places them with confu_jax.sharding.put_tree).
        return jax.jit(lambda: llama_init(cfg, jax.random.PRNGKey(frozen_seed)),
                       out_shardings=shardings)()

    def train_iterator(process_index, process_count):
        return AffineSequences(toy.global_batch_size, toy.seq_len, cfg.vocab_size, toy.prompt_len,
                               toy.data_seed, process_index, process_count)

    def eval_batches(process_index, process_count):
        src = AffineSequences(toy.global_batch_size, toy.seq_len, cfg.vocab_size, toy.prompt_len,
                              toy.data_seed + 10_000, process_index, process_count)
        return [src.batch_at(i) for i in range(toy.eval_batches)]

    return TrainTask(
        init_params=lambda rng: init_head(rng, cfg.d_model, len(taps), toy.ttt_steps, toy.head_dim),
        frozen_abstract=param_shapes(cfg),
        load_frozen=load_frozen,
        loss_fn=loss_fn,
        train_iterator=train_iterator,
        eval_batches=eval_batches,
        eval_fn=eval_fn,
        axis_units=shd.llama_axis_units(cfg.head_dim),
        description=f"toy multi-step head on frozen '{config.model.preset}' target",
    )
