"""Tiny random target + ConFu head for model-component tests (no checkpoint, CPU, float32)."""

import jax
import numpy as np

import jax.numpy as jnp

from confu_jax.models.llama import param_shapes
from confu_jax.models.params import trainable_shapes
from confu_jax.models.presets import get_preset
from confu_jax.models.spec import HeadConfig, ModelSpec

DRAFT_VOCAB = 96


def tiny_spec(variant: str = "confu", **head_kw) -> ModelSpec:
    # init scales large enough that soft prompts, [con] and [f] visibly move outputs
    kw = dict(variant=variant, draft_vocab_size=DRAFT_VOCAB, n_soft_prompts=4, n_expert=4, expert_top_k=2,
              init_std=0.2, soft_prompt_init_std=1.0)
    kw.update(head_kw)
    return ModelSpec(get_preset("tiny"), HeadConfig(**kw))


def _fill(shapes, rng: np.random.Generator, std: float, overrides: dict):
    """Random values for a shape tree with numpy: no XLA compile (JAX's PRNG compiles slowly on CPU).
    Norm scales are 1 + noise; leaves whose path contains a key of ``overrides`` use that std."""

    def leaf(path, x):
        names = [getattr(k, "key", "") for k in path]
        if names[-1] == "scale":
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(x.shape), x.dtype)
        s = next((v for k, v in overrides.items() if k in names), std)
        return jnp.asarray(s * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def tiny_params(spec: ModelSpec, seed: int = 0):
    """(target_params, trainable) — ``trainable = {'draft': ..., 'confu': ...}``."""
    rng = np.random.default_rng(seed)
    target = _fill(param_shapes(spec.target), rng, 0.1, {})
    trainable = _fill(trainable_shapes(spec), rng, spec.head.init_std,
                      {"soft_prompt_k_lphd": spec.head.soft_prompt_init_std,
                       "soft_prompt_v_lphd": spec.head.soft_prompt_init_std})
    return target, trainable


def tiny_objective_case(variant: str, seed: int = 3, vocab: int = 6, rows: int = 2, length: int = 24):
    """A tiny target over a 6-token vocabulary with a random head over a 4-of-6 draft vocabulary (so
    t2d matters; top-1 hits are common, so accuracy metrics are not vacuous) and a batch of two rows
    with a prompt, two answers and right padding -> (spec, target params, trainable, draft vocab, batch)."""
    from confu_jax.models.vocab_map import draft_vocab_from_d2t

    target = get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=())
    spec = ModelSpec(target, HeadConfig(variant=variant, draft_vocab_size=4, n_soft_prompts=4, n_expert=4,
                                        expert_top_k=2, init_std=0.2, soft_prompt_init_std=1.0))
    tp, tr = tiny_params(spec, seed)
    dv = draft_vocab_from_d2t(np.array([0, 2, 3, 5]), vocab)
    rng = np.random.default_rng(seed + 1)
    lm = np.zeros((rows, length), bool)
    lm[0, 4:14] = lm[0, 16:23] = True
    lm[1, 6:19] = True
    attention = np.ones((rows, length), bool)
    attention[1, 20:] = False
    batch = {"tokens": jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32), "loss_mask": jnp.asarray(lm),
             "attention_mask": jnp.asarray(attention)}
    return spec, tp, tr, dv, batch


def random_parents(rng: np.random.Generator, t: int) -> np.ndarray:
    """A random tree in topological order: node 0 the root, parent[i] < i (often i-1 for depth)."""
    parents = np.full((t,), -1, np.int32)
    for i in range(1, t):
        parents[i] = i - 1 if rng.random() < 0.4 else rng.integers(0, i)
    return parents


def path_to(parents: np.ndarray, i: int) -> list:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def random_target(vocab: int, seed: int = 0):
    """(config, params): the tiny preset over ``vocab`` tokens, weights N(0, 0.1²) (norm scales 1 +
    noise) — varied enough that its greedy text is not one repeated token."""
    cfg = get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=())
    return cfg, _fill(param_shapes(cfg), np.random.default_rng(seed), 0.1, {})
