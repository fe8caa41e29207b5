"""A few dozen AdamW steps on the tiny target lower the held-out loss and raise the simulated
acceptance length, for EAGLE-3 and ConFu.

Data is self-distilled, as ConFu/EAGLE-3 train: random 4-token prompts continued greedily by the
tiny random target itself, so the answers are exactly the target's argmax chain (a learnable,
deterministic structure) and the simulated τ is exact for them (see ``simulated_acceptance_length``).
Evaluation reuses the compiled training step on a held-out batch (its metrics are computed at the
parameters before the update, which is discarded), so each variant compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.data.draft_vocab import build_draft_vocab, count_answer_tokens
from confu_jax.models.vocab_map import draft_vocab_from_d2t
from confu_jax.models.llama import Llama
from confu_jax.train.loss import ObjectiveConfig, confu_loss
from tests.helpers.model_fakes import tiny_params, tiny_spec

PROMPT, N, ROWS, BATCH, STEPS = 4, 32, 40, 8, 40
CFG = ObjectiveConfig(ttt_steps=3, k_train=8, replication=3, max_lag=3, vocab_chunk=48)


@functools.lru_cache(maxsize=1)
def _data():
    spec = tiny_spec("eagle3")
    target, _ = tiny_params(spec, seed=0)
    cfg = spec.target

    @jax.jit
    def greedy(prompts):
        buf = jnp.zeros((prompts.shape[0], N), jnp.int32).at[:, :PROMPT].set(prompts)
        pos = jnp.broadcast_to(jnp.arange(N), buf.shape)

        def body(t, buf):
            logits = Llama(cfg).apply({"params": target}, buf, pos).logits_btv
            return buf.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))

        return jax.lax.fori_loop(PROMPT, N, body, buf)

    prompts = np.random.default_rng(0).integers(2, cfg.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    tokens = np.asarray(greedy(jnp.asarray(prompts)))
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[:, PROMPT:] = True
    vocab = build_draft_vocab(count_answer_tokens(zip(tokens, loss_mask), cfg.vocab_size),
                              spec.head.draft_vocab_size, always_include=cfg.eos_token_ids)
    batches = [{"tokens": jnp.asarray(tokens[i:i + BATCH]), "loss_mask": jnp.asarray(loss_mask[i:i + BATCH])}
               for i in range(0, ROWS, BATCH)]
    return target, draft_vocab_from_d2t(vocab.d2t, cfg.vocab_size), batches[:-1], batches[-1]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "confu"])
def test_training_lowers_loss_and_raises_acceptance(variant):
    target, draft_vocab, train, held_out = _data()
    spec = tiny_spec(variant, init_std=0.02, soft_prompt_init_std=0.02)  # the configs' init scale
    _, trainable = tiny_params(spec, seed=1)
    tx = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.0)

    @jax.jit
    def step(params, opt_state, batch, rng):
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: confu_loss(spec, p, target, draft_vocab, batch, rng, CFG), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    opt_state = tx.init(trainable)
    eval_rng = jax.random.PRNGKey(123)
    before = jax.device_get(step(trainable, opt_state, held_out, eval_rng)[2:])
    rng, losses = jax.random.PRNGKey(0), []
    for i in range(STEPS):
        rng, k = jax.random.split(rng)
        trainable, opt_state, loss, _ = step(trainable, opt_state, train[i % len(train)], k)
        losses.append(float(loss))
    after = jax.device_get(step(trainable, opt_state, held_out, eval_rng)[2:])

    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    assert float(after[0]) < 0.8 * float(before[0])
    tau0, tau1 = float(before[1]["acceptance_length"]), float(after[1]["acceptance_length"])
    print(f"{variant}: held-out loss {float(before[0]):.3f} -> {float(after[0]):.3f}, tau {tau0:.3f} -> {tau1:.3f}")
    assert tau1 > tau0 + 0.2, (tau0, tau1)
    assert float(after[1]["acc/step0"]) > float(before[1]["acc/step0"]) + 0.1

    # The briefly trained head in the real decode loop: lossless (== AR greedy) and it accepts.
    from confu_jax.decode import loop
    from confu_jax.decode.loaded import head_weights
    from confu_jax.decode import plans
    from confu_jax.decode.generate import generate_ar

    prompts = [list(map(int, r[:PROMPT])) for r in np.asarray(held_out["tokens"])[:4]]
    params = head_weights(spec.target, target, spec.head, trainable, draft_vocab, True, "trained")
    sp = loop.generate_speculative(params.target, HeadDrafter(plans.parse_plan("dynamic:3,2,6")),
                                   params.drafter_params, prompts,
                                   max_new_tokens=N - PROMPT, eos_ids=())
    ar = generate_ar(target, spec.target, prompts, max_new_tokens=N - PROMPT, eos_ids=())
    assert np.array_equal(np.asarray(sp.tokens_bn), np.asarray(ar.tokens_bn))
    real_tau = float(np.asarray(sp.accept_log_bi).sum() / np.asarray(sp.n_passes_b).sum())
    print(f"{variant}: tau in the decode loop {real_tau:.2f}")
    assert real_tau > 1.3, real_tau
