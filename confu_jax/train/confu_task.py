"""The ConFu / EAGLE-3 training task: what ``launch.train`` trains for a ``configs/<target>_<variant>.py``.

Builds a :class:`~confu_jax.train.task.TrainTask` from the full config:

* model: ``ModelSpec`` from ``config.model/confu/draft``; the frozen target from
  ``config.model.source`` (``'asset:<name>'``, a GGUF file or a Hugging Face directory, checked
  against the preset's parameter shapes) or ``'random'`` (random weights: tests and smoke runs);
* objective: :func:`confu_jax.train.loss.confu_loss` with ``config.objective`` (training: K_train
  sampled anchors, replication window l; evaluation: every candidate position an anchor, l = 0);
* data: the grain pipeline over ``config.data.train_files`` with the last
  ``config.objective.eval_records`` conversations held out for evaluation, and the draft
  vocabulary counted on the training conversations (saved with every checkpoint). With
  ``source='random'`` the data are self-distilled instead: random prompts continued greedily by
  the random target (:class:`SelfDistilledStream`), which has a learnable structure and needs
  no tokenizer.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from confu_jax import sharding as shd
from confu_jax.models.llama import Llama, LlamaConfig, init_params as llama_init, param_shapes
from confu_jax.models.params import init_trainable
from confu_jax.models.spec import ModelSpec, model_spec_from_config
from confu_jax.train.loss import confu_loss, lm_head_layout, objective_from_config
from confu_jax.train.task import TrainTask

log = logging.getLogger(__name__)

BATCH_KEYS = ("tokens", "loss_mask", "attention_mask")


def default_objective_config() -> ml_collections.ConfigDict:
    """``config.objective``: the loss settings not already in ``config.confu`` / ``config.draft``."""
    c = ml_collections.ConfigDict()
    # Anchors per row (ConFu; the paper gives no value). With l = 3 the windows of 256 anchors cover
    # up to 1024 of 2048 positions at a contemplate cost of N + 256 tokens instead of 2N.
    c.k_train = 256
    # Evaluation anchors per row; 0 = every candidate position (each index then drafts with the
    # future prediction made at that index, as at inference; the window is 0 in evaluation).
    c.eval_k = 0
    c.vocab_chunk = 8192  # columns per step of the full-vocabulary argmax scan (memory B·N·chunk·4)
    c.remat = True  # recompute each TTT step's draft logits in the backward pass
    c.eval_records = 64  # last conversations of the training files held out (0 = no evaluation)
    c.eval_batches = 2  # held-out global batches evaluated every train.eval_every steps
    return c


def default_synthetic_config() -> ml_collections.ConfigDict:
    """``config.synthetic`` (only for ``model.source='random'``): self-distilled random prompts."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # random target weights and prompts
    c.prompt_len = 4  # prompt tokens (not trained on); the rest of data.max_length is the answer
    return c


# ----------------------------------------------------------------------------- data


class _KeepKeys:
    """A batch iterator restricted to the keys the loss reads (checkpointable like the inner one)."""

    def __init__(self, inner, keys=BATCH_KEYS):
        self.inner, self.keys = inner, keys

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        return {k: np.asarray(batch[k]) for k in self.keys}

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state) -> None:
        self.inner.set_state(state)


class SelfDistilledStream:
    """Deterministic batches of random prompts continued greedily by a (random) target.

    Batch ``i`` is a function of (seed, i) only, so the iterator state is the position. Rows:
    ``prompt_len`` random tokens (loss-masked out) + the target's greedy continuation to
    ``seq_len`` (the answer) — the shape of self-distilled training data, without a tokenizer.
    """

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

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        return {"position": int(self.position), "seed": int(self.seed)}

    def set_state(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"data state seed {state['seed']} != configured synthetic.seed {self.seed}")
        self.position = int(state["position"])


def _greedy_fill(cfg: LlamaConfig, prompt_len: int, params: dict, buf_bn: jax.Array) -> jax.Array:
    """Fill positions prompt_len.. of ``buf_bn`` with the target's greedy continuation."""
    pos = jnp.broadcast_to(jnp.arange(buf_bn.shape[1]), buf_bn.shape)

    def body(t, buf):
        logits = Llama(cfg).apply({"params": params}, buf, pos).logits_btv
        return buf.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))

    return jax.lax.fori_loop(prompt_len, buf_bn.shape[1], body, buf_bn)


def _process_rows(batch: dict, process_index: int, process_count: int) -> dict:
    n = next(iter(batch.values())).shape[0]
    lo, hi = process_index * n // process_count, (process_index + 1) * n // process_count
    return {k: v[lo:hi] for k, v in batch.items()}


# ----------------------------------------------------------------------------- target


def _strip_asset(source: str) -> str:
    return source[len("asset:"):] if source.startswith("asset:") else source


def load_target(config, spec: ModelSpec) -> tuple[ModelSpec, dict]:
    """(spec with the checkpoint's LlamaConfig, host params) for ``config.model.source``."""
    source = config.model.source
    if source == "random":
        seed = int(config.synthetic.seed) if "synthetic" in config else 0
        params = jax.device_get(llama_init(spec.target, jax.random.PRNGKey(seed)))
        return spec, params
    if not source:
        raise ValueError(f"config.model.source is empty for preset {config.model.preset!r}: pass "
                         "--config.model.source=/path/to/checkpoint (GGUF file or Hugging Face directory)")
    from confu_jax.weights import load_model

    cfg, params = load_model(_strip_asset(source), config.model.param_dtype)
    want = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), param_shapes(spec.target))
    got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), params)
    if want != got:
        bad = [(jax.tree_util.keystr(p), w, g) for (p, w), g in
               zip(jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple)),
                   jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, tuple))) if w != g][:5]
        raise ValueError(f"{source}: parameters do not match preset {config.model.preset!r} "
                         f"(path, expected, found): {bad or 'different tree structure'}")
    target = cfg.replace(dtype=spec.target.dtype, param_dtype=spec.target.param_dtype,
                         attention_impl=spec.target.attention_impl)
    return ModelSpec(target, spec.head), params


# ----------------------------------------------------------------------------- the task


def build_task(config) -> TrainTask:
    lm_head_init = str(config.draft.get("lm_head_init", "random"))
    if lm_head_init not in ("random", "target"):
        raise ValueError(f"config.draft.lm_head_init: expected 'random' or 'target', got {lm_head_init!r}")
    spec, target_host = load_target(config, model_spec_from_config(config))
    train_obj = objective_from_config(config)
    eval_obj = objective_from_config(config, evaluation=True)
    data = config.data
    synthetic = config.model.source == "random"

    if synthetic:
        from confu_jax.data.draft_vocab import build_draft_vocab, count_answer_tokens

        def stream(pidx=0, pcount=1, seed_offset=0):
            return SelfDistilledStream(spec.target, target_host, global_batch=int(data.global_batch_size),
                                       seq_len=int(data.max_length), prompt_len=int(config.synthetic.prompt_len),
                                       seed=int(config.synthetic.seed) + seed_offset, process_index=pidx,
                                       process_count=pcount)

        counted = [stream().batch_at(i) for i in range(4)]
        counts = count_answer_tokens(((t, m) for b in counted for t, m in zip(b["tokens"], b["loss_mask"])),
                                     spec.target.vocab_size)
        vocab = build_draft_vocab(counts, spec.head.draft_vocab_size, always_include=spec.target.eos_token_ids)

        def train_iterator(pidx, pcount):
            return stream(pidx, pcount)

        def eval_batches(pidx, pcount):
            held = stream(pidx, pcount, seed_offset=10_000)
            return [held.batch_at(i) for i in range(int(config.objective.eval_batches))]
    else:
        vocab, train_iterator, eval_batches = _real_data(config, spec)

    if vocab.draft_size != spec.head.draft_vocab_size or vocab.target_size != spec.target.vocab_size:
        raise ValueError(f"draft vocabulary maps {vocab.draft_size} ids onto {vocab.target_size}; the model "
                         f"expects {spec.head.draft_vocab_size} onto {spec.target.vocab_size}")
    draft_vocab = {"d2t": jnp.asarray(vocab.d2t, jnp.int32), "t2d": jnp.asarray(vocab.t2d)}

    def loss_fn(trainable, frozen, batch, rng):
        return confu_loss(spec, trainable, frozen, draft_vocab, batch, rng, train_obj)

    def eval_fn(trainable, frozen, batch, rng):
        loss, metrics = confu_loss(spec, trainable, frozen, draft_vocab, batch, rng, eval_obj)
        return dict(metrics, loss=loss)

    head_rows = head_from_target(spec, target_host, vocab.d2t) if lm_head_init == "target" else None

    def init_params(rng):
        params = init_trainable(spec, rng)
        if head_rows is not None:
            draft = dict(params["draft"])
            draft["lm_head"] = {"kernel": jnp.asarray(head_rows["lm_head"], draft["lm_head"]["kernel"].dtype)}
            draft["final_norm"] = {"scale": jnp.asarray(head_rows["final_norm"], draft["final_norm"]["scale"].dtype)}
            params = dict(params, draft=draft)
        return params

    return TrainTask(
        init_params=init_params,
        frozen_abstract=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target_host),
        load_frozen=lambda shardings: shd.put_tree(target_host, shardings),
        loss_fn=loss_fn,
        train_iterator=train_iterator,
        eval_batches=eval_batches if int(config.objective.eval_batches) > 0 else None,
        eval_fn=eval_fn,
        axis_units=shd.llama_axis_units(spec.target.head_dim),
        extra_arrays={"draft_vocab_d2t": np.asarray(vocab.d2t), "draft_vocab_t2d": np.asarray(vocab.t2d)},
        description=(f"{spec.head.variant} draft head on '{config.model.preset}' "
                     f"({'self-distilled random data' if synthetic else data.train_files}), "
                     f"L_ttt={train_obj.ttt_steps}, K_train={train_obj.k_train}, l={train_obj.replication}"),
    )


def head_from_target(spec: ModelSpec, target_params: dict, d2t: np.ndarray) -> dict:
    """The draft's ``lm_head`` kernel [d, V_draft] and ``final_norm`` scale [d] taken from the target.

    The draft layer's output plays the part of the target's last hidden state (both feed an LM head
    after an RMSNorm), which makes the target's norm and vocabulary rows a candidate start. Measured
    on SmolLM2 it trained slower than a random head (docs/RESULTS.md, "What helped, what did not").
    """
    from confu_jax.models.vocab_map import lm_head_from_target

    w, vocab_axis = lm_head_layout(spec, target_params)
    return {"lm_head": np.asarray(lm_head_from_target(w, vocab_axis, d2t)),
            "final_norm": np.asarray(target_params["final_norm"]["scale"])}


def _real_data(config, spec: ModelSpec):
    """(draft vocab, train_iterator, eval_batches) over conversations, with a held-out tail."""
    from confu_jax.data import formats, pipeline
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.draft_vocab import draft_vocab_for_training

    data = config.data
    tokenizer = ChatTokenizer.load(_strip_asset(config.model.source))
    conversations, report = formats.load_conversations(
        pipeline.train_files(data), on_bad_record=data.on_bad_record, max_records=data.max_records or None)
    log.info("training data: %s", report.summary())
    n_eval = min(int(config.objective.eval_records), len(conversations) // 2)
    train_convs = conversations[:len(conversations) - n_eval]
    eval_convs = conversations[len(conversations) - n_eval:]
    vocab = draft_vocab_for_training(data, tokenizer, spec.target.vocab_size, conversations=train_convs)

    def train_iterator(pidx, pcount):
        return _KeepKeys(pipeline.make_train_iterator(config, tokenizer, pidx, pcount, seed=int(config.train.seed),
                                                      conversations=train_convs))

    def eval_batches(pidx, pcount):
        rows = [r for r in (pipeline.encode_example(c["messages"], tokenizer, int(data.max_length),
                                                    int(data.min_loss_tokens)) for c in eval_convs) if r is not None]
        g = int(data.global_batch_size)
        out = []
        for i in range(min(int(config.objective.eval_batches), len(rows) // g)):
            batch = {k: np.stack([r[k] for r in rows[i * g:(i + 1) * g]]) for k in BATCH_KEYS}
            out.append(_process_rows(batch, pidx, pcount))
        if not out:
            log.warning("no held-out batch: %d usable eval conversations < data.global_batch_size=%d", len(rows), g)
        return out

    return vocab, train_iterator, eval_batches
