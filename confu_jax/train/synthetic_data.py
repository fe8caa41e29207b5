"""Self-distilled synthetic training data for targets with random weights (tests, smoke runs).

With ``model.source='random'`` there is no tokenizer and no text, yet training should still see
the structure real self-distilled data has: answers that are the target's own greedy
continuation. Random prompts continued greedily by the random target give exactly that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from confu_jax.models.llama import Llama, LlamaConfig
from confu_jax.models.spec import ModelSpec
from confu_jax.train.streams import PositionStream


def default_synthetic_config() -> ml_collections.ConfigDict:
    """``config.synthetic`` (only for ``model.source='random'``): self-distilled random prompts."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # random target weights and prompts
    c.prompt_len = 4  # prompt tokens (not trained on); the rest of data.max_length is the answer
    return c


class SelfDistilledStream(PositionStream):
    """Deterministic batches of random prompts continued greedily by a (random) target.

    Batch ``i`` is a function of (seed, i) only, so the iterator state is the position. Rows:
    ``prompt_len`` random tokens (loss-masked out) + the target's greedy continuation to
    ``seq_len`` (the answer) — the shape of self-distilled training data, without a tokenizer.
    """

    seed_setting = "synthetic.seed"

    def __init__(self, cfg: LlamaConfig, params: dict, *, global_batch: int, seq_len: int, prompt_len: int,
                 seed: int, process_index: int = 0, process_count: int = 1):
        if global_batch % process_count:
            raise ValueError(f"data.global_batch_size={global_batch} is not divisible by {process_count} processes")
        if not 1 <= prompt_len < seq_len - 2:
            raise ValueError(f"synthetic.prompt_len={prompt_len} must be in [1, data.max_length - 2 = {seq_len - 2})")
        self.cfg, self.params = cfg, params
        self.global_batch, self.seq_len, self.prompt_len, self.seed = global_batch, seq_len, prompt_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.position = 0
        self._greedy = jax.jit(functools.partial(_greedy_fill, cfg, prompt_len))

    def batch_at(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        prompts = rng.integers(0, self.cfg.vocab_size, (self.global_batch, self.prompt_len)).astype(np.int32)
        buf = np.zeros((self.global_batch, self.seq_len), np.int32)
        buf[:, :self.prompt_len] = prompts
        tokens = np.asarray(self._greedy(self.params, jnp.asarray(buf)))[self.rows]
        loss_mask = np.zeros(tokens.shape, bool)
        loss_mask[:, self.prompt_len:] = True
        return {"tokens": tokens, "loss_mask": loss_mask, "attention_mask": np.ones(tokens.shape, bool)}


def _greedy_fill(cfg: LlamaConfig, prompt_len: int, params: dict, buf_bn: jax.Array) -> jax.Array:
    """Fill positions prompt_len.. of ``buf_bn`` with the target's greedy continuation."""
    pos = jnp.broadcast_to(jnp.arange(buf_bn.shape[1]), buf_bn.shape)

    def body(t, buf):
        logits = Llama(cfg).apply({"params": params}, buf, pos).logits_btv
        return buf.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))

    return jax.lax.fori_loop(prompt_len, buf_bn.shape[1], body, buf_bn)


class ShapeOnlyBatches:
    """Batches of the configured shape and nothing else (``model.source='abstract'``): what the
    train step is compiled for when no data exist. Every row is one full-length conversation
    (``pack``: one segment per row), so no position is padding and the compiled step is the one a
    full batch runs. Keys and dtypes are the data pipeline's (``data.pipeline``). Refuses to be checkpointed: an abstract run compiles, it never trains."""

    def __init__(self, rows: int, seq_len: int, packed: bool):
        self.batch = {"tokens": np.zeros((rows, seq_len), np.int32),
                      "loss_mask": np.ones((rows, seq_len), bool),
                      "attention_mask": np.ones((rows, seq_len), bool)}
        if packed:
            self.batch["segment_ids"] = np.ones((rows, seq_len), np.int32)
            self.batch["positions"] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return dict(self.batch)

    def get_state(self):
        raise RuntimeError("model.source='abstract' has shapes but no weights or data: it compiles "
                           "(launch.train --compile_only), it does not train")

    set_state = get_state


def abstract_data(config, spec):
    """(draft vocab, train_iterator, eval_batches=None) for ``model.source='abstract'``: the draft
    vocabulary is a fixed random V_draft of the target's ids (its size is all the step's shapes
    depend on)."""
    from confu_jax.data.draft_vocab import DraftVocab

    vd, v = spec.head.draft_vocab_size, spec.target.vocab_size
    # a spread-out subset, not the first V_draft ids: an identity-like map is a constant XLA may simplify
    d2t = np.sort(np.random.default_rng(0).choice(v, vd, replace=False)).astype(np.int32)
    t2d = np.zeros(v, bool)
    t2d[d2t] = True
    vocab = DraftVocab(d2t=d2t, t2d=t2d, counts=np.zeros(vd, np.int64))
    g, n = int(config.data.global_batch_size), int(config.data.max_length)
    packed = bool(config.data.get("pack", False))

    def train_iterator(pidx, pcount):
        return ShapeOnlyBatches(g // pcount, n, packed)

    return vocab, train_iterator, None


def synthetic_data(config, spec: ModelSpec, target_host: dict):
    """(draft vocab, train_iterator, eval_batches) of self-distilled random prompts (``source='random'``)."""
    from confu_jax.data.draft_vocab import build_draft_vocab, count_answer_tokens

    data = config.data

    def stream(pidx=0, pcount=1, seed_offset=0):
        return SelfDistilledStream(spec.target, target_host, global_batch=int(data.global_batch_size),
                                   seq_len=int(data.max_length), prompt_len=int(config.synthetic.prompt_len),
                                   seed=int(config.synthetic.seed) + seed_offset, process_index=pidx,
                                   process_count=pcount)

    counted = [stream().batch_at(i) for i in range(4)]
    counts = count_answer_tokens(((t, m) for b in counted for t, m in zip(b["tokens"], b["loss_mask"])),
                                 spec.target.vocab_size)
    vocab = build_draft_vocab(counts, spec.head.draft_vocab_size, always_include=spec.target.eos_token_ids)

    def eval_batches(pidx, pcount):
        held = stream(pidx, pcount, seed_offset=10_000)
        return [held.batch_at(i) for i in range(int(config.objective.eval_batches))]

    return vocab, (lambda pidx, pcount: stream(pidx, pcount)), eval_batches
