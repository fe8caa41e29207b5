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
  the random target (``train.synthetic_data``), which has a learnable structure and needs
  no tokenizer. With ``config.data.target_features`` (EAGLE-3 only) the batches come from a store
  of offline target features (``launch.target_features``) and carry the taps and the teacher, so
  the loss skips the target pass; the draft vocabulary is the store's.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from confu_jax import sharding as shd
from confu_jax.models.params import init_trainable
from confu_jax.models.spec import ModelSpec, model_spec_from_config
from confu_jax.models.vocab_map import lm_head_from_target
from confu_jax.runs.heads import target_fingerprint
from confu_jax.train.loss import confu_loss, objective_from_config
from confu_jax.train.teacher import lm_head_layout
from confu_jax.train.real_data import real_data
from confu_jax.train.synthetic_data import abstract_data, synthetic_data
from confu_jax.models.llama import param_shapes
from confu_jax.train.target_loading import (is_abstract, load_target, load_target_sharded, sharded_source,
                                            target_name)
from confu_jax.train.task import TrainTask

log = logging.getLogger(__name__)


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
    # positions per chunk of the draft head + KL (train.loss._head_kl_scan): live logits [B, chunk, V_draft]
    c.token_chunk = 1024
    # recompute each TTT step's draft MLP in the backward pass: [B, N, ffn] activations of one step alive, not L_ttt
    c.remat_mlp = True
    # ConFu, not the paper's (0 = the paper): an auxiliary loss training the contemplate's f to name
    # x[t+2 .. t+1+future_aux_ahead] through the target's frozen LM head (train.loss.future_aux_loss),
    # its weight falling linearly to 0 over future_aux_anneal_steps (0: constant)
    c.future_aux_weight = 0.0
    c.future_aux_ahead = 1
    c.future_aux_anneal_steps = 0
    # what each TTT step trains the draft's q toward the teacher's p with (train.loss.STEP_LOSSES): 'kl' (forward KL,
    # EAGLE-3's), 'rkl', 'jsd', 'tv' (1 - acceptance probability), 'nla' (-log acceptance), 'lk' (the LK hybrid),
    # 'ce' (the teacher's argmax as label)
    c.step_loss = "kl"
    c.eval_records = 64  # last conversations of the training files held out (0 = no evaluation)
    c.eval_batches = 2  # held-out global batches evaluated every train.eval_every steps
    return c


def check_training_config(config) -> None:
    """Settings training cannot run with, refused before any work (the message says why)."""
    impl = config.model.attention_impl
    if impl != "xla":
        raise ValueError(f"config.model.attention_impl={impl!r} cannot train: the Pallas tree-attention kernel "
                         "has no VJP (it is an inference kernel, docs/DESIGN.md §6); train with 'xla' and "
                         "decode with 'pallas'")
    lm_head_init = str(config.draft.get("lm_head_init", "random"))
    if lm_head_init not in ("random", "target"):
        raise ValueError(f"config.draft.lm_head_init: expected 'random' or 'target', got {lm_head_init!r}")
    warn_if_windows_unused(config)


def warn_if_windows_unused(config) -> bool:
    """ConFu's replication window only matters when anchors are sparse: with K_train anchors per
    row and at most N - 2 candidate positions, K_train·(l+1) >= N - 2 leaves nearly every index
    covered by an anchor at (or next to) itself, so the window trains ~nothing beyond l = 0."""
    from confu_jax.models.registry import get_variant

    k, l_win, n = int(config.objective.k_train), int(config.confu.replication), int(config.data.max_length)
    if not get_variant(config.confu.variant).has_future or k <= 0 or l_win == 0 or k * (l_win + 1) < n - 2:
        return False
    log.warning("objective.k_train=%d anchors x (confu.replication=%d + 1) >= the %d candidate positions of "
                "rows of data.max_length=%d: the replication windows have (almost) no effect; use k_train <= "
                "%d for windows that matter", k, l_win, n - 2, n, max(1, (n - 2) // (2 * (l_win + 1))))
    return True


def _init_params_fn(spec: ModelSpec, head_rows):
    """rng -> trainable params, with the draft LM head taken from the target when ``head_rows``."""

    def init_params(rng):
        params = init_trainable(spec, rng)
        if head_rows is not None:
            draft = dict(params["draft"])
            draft["lm_head"] = {"kernel": jnp.asarray(head_rows["lm_head"], draft["lm_head"]["kernel"].dtype)}
            draft["final_norm"] = {"scale": jnp.asarray(head_rows["final_norm"], draft["final_norm"]["scale"].dtype)}
            params = dict(params, draft=draft)
        return params

    return init_params


def build_task(config) -> TrainTask:
    """The TrainTask of a ``configs/<target>_<variant>.py`` config (see the module docstring)."""
    return build_head_task(config)


def build_head_task(config, losses=None, objective_text: str = "") -> TrainTask:
    """The TrainTask of a head (EAGLE-3 / ConFu, or another objective on the same head, target, data
    and draft vocabulary: ``losses(spec, draft_vocab) -> (loss_fn, eval_fn)``, P-EAGLE's
    ``train.peagle_task``; ``objective_text`` then describes it). Default: ``confu_loss``."""
    check_training_config(config)
    # A Hugging Face target goes straight into its shardings when the run starts (each process reads
    # only its devices' slices); the paths that read target weights while building the task (an
    # offline feature store's fingerprint check, the draft LM head from the target's rows) load it on the host.
    sharded = (sharded_source(config) and not config.data.get("target_features", "")
               and str(config.draft.get("lm_head_init", "random")) != "target")
    if sharded:
        spec = model_spec_from_config(config)
        target_host = param_shapes(spec.target)
    else:
        spec, target_host = load_target(config, model_spec_from_config(config))
    train_obj = objective_from_config(config)
    eval_obj = objective_from_config(config, evaluation=True)
    synthetic = config.model.source == "random"
    abstract = is_abstract(config.model.source)
    offline = bool(config.data.get("target_features", ""))
    if abstract and offline:
        raise ValueError("config.model.source='abstract' compiles the online step; unset "
                         "config.data.target_features (an offline step has the same draft, without the target pass)")
    if abstract and str(config.draft.get("lm_head_init", "random")) == "target":
        raise ValueError("config.draft.lm_head_init='target' reads the target's weights; an abstract target "
                         "has none (the compiled step is the same with 'random')")
    if abstract:
        rows_per_epoch = None
        vocab, train_iterator, eval_batches = abstract_data(config, spec)
    elif offline:  # stored taps + teacher (launch.target_features): the loss skips the target pass
        if spec.head.has_future:
            raise ValueError(f"config.data.target_features is set but variant {spec.head.variant!r} needs the "
                             "target's per-layer K/V for its contemplates (recomputed, not stored: docs/DESIGN.md "
                             "§4 'Offline target features'); offline features train eagle3 only")
        from confu_jax.train.target_features import offline_data

        vocab, train_iterator, eval_batches, rows_per_epoch = offline_data(config, spec,
                                                                           target_fingerprint(target_host))
    else:
        rows_per_epoch = None
        vocab, train_iterator, eval_batches = (synthetic_data(config, spec, target_host) if synthetic
                                               else real_data(config, spec))
    if vocab.draft_size != spec.head.draft_vocab_size or vocab.target_size != spec.target.vocab_size:
        raise ValueError(f"draft vocabulary maps {vocab.draft_size} ids onto {vocab.target_size}; the model "
                         f"expects {spec.head.draft_vocab_size} onto {spec.target.vocab_size}")
    draft_vocab = {"d2t": jnp.asarray(vocab.d2t, jnp.int32), "t2d": jnp.asarray(vocab.t2d)}

    def confu_losses(spec, draft_vocab):
        def loss_fn(trainable, frozen, batch, rng):
            return confu_loss(spec, trainable, frozen, draft_vocab, batch, rng, train_obj)

        def eval_fn(trainable, frozen, batch, rng):
            loss, metrics = confu_loss(spec, trainable, frozen, draft_vocab, batch, rng, eval_obj)
            return dict(metrics, loss=loss)

        return loss_fn, eval_fn

    loss_fn, eval_fn = (losses or confu_losses)(spec, draft_vocab)
    objective_text = objective_text or (f"L_ttt={train_obj.ttt_steps}, K_train={train_obj.k_train}, "
                                        f"l={train_obj.replication}")

    use_target_head = str(config.draft.get("lm_head_init", "random")) == "target"
    head_rows = head_from_target(spec, target_host, vocab.d2t) if use_target_head else None
    return TrainTask(
        init_params=_init_params_fn(spec, head_rows),
        frozen_abstract=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target_host),
        load_frozen=(lambda shardings: shd.with_shardings(target_host, shardings)) if abstract
        else (lambda shardings: load_target_sharded(config, spec, shardings)) if sharded
        else (lambda shardings: shd.put_tree(target_host, shardings)),
        loss_fn=loss_fn,
        train_iterator=train_iterator,
        eval_batches=eval_batches if int(config.objective.eval_batches) > 0 and eval_batches else None,
        eval_fn=eval_fn,
        axis_units=shd.llama_axis_units(spec.target.head_dim),
        rows_per_epoch=rows_per_epoch,
        extra_arrays={"draft_vocab_d2t": np.asarray(vocab.d2t), "draft_vocab_t2d": np.asarray(vocab.t2d)},
        target_fingerprint=None if abstract else target_fingerprint if sharded else target_fingerprint(target_host),
        target_source=str(config.model.source),
        description=(f"{spec.head.variant} draft head on '{target_name(config)}' "
                     f"({'self-distilled random data' if synthetic else config.data.train_files}"
                     f"{', offline target features ' + config.data.target_features if offline else ''}), "
                     f"{objective_text}"),
    )


def head_from_target(spec: ModelSpec, target_params: dict, d2t: np.ndarray) -> dict:
    """The draft's ``lm_head`` kernel [d, V_draft] and ``final_norm`` scale [d] taken from the target.

    The draft layer's output plays the part of the target's last hidden state (both feed an LM head
    after an RMSNorm), which makes the target's norm and vocabulary rows a candidate start. Measured
    on SmolLM2 it trained slower than a random head (docs/RESULTS.md, "What helped, what did not").
    """
    w, vocab_axis = lm_head_layout(spec, target_params)
    return {"lm_head": np.asarray(lm_head_from_target(w, vocab_axis, d2t)),
            "final_norm": np.asarray(target_params["final_norm"]["scale"])}
