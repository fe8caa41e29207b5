"""The decode programs traced with shape-only parameters: what a mesh compiles, asked before any
weights exist (``launch.decode_cost``, the scale tests). Above ``generate``, ``loop`` and ``sharded``,
which it combines; none of them imports it."""

from __future__ import annotations

from jax.sharding import Mesh

from confu_jax.decode import generate, loop
from confu_jax.decode.sharded import abstract_params


def trace_loops(spec, mesh: Mesh, drafter, prompt_len: int = 8, max_new_tokens: int = 32,
                max_len: int = 128, unroll_layers: bool = False) -> dict:
    """The AR and speculative programs of a head's ``spec`` drafting with ``drafter`` (a
    ``decode.drafting.HeadDrafter``) traced on ``mesh`` with shape-only parameters
    -> {'ar': Traced, 'speculative': Traced}; ``.lower()`` / ``.lower(lowering_platforms=('tpu',))``
    them. Scanned layers by default: the form GPU/TPU run (docs/DESIGN.md §7)."""
    target, dp = abstract_params(spec, mesh)
    prompt = [[i % spec.target.vocab_size for i in range(1, prompt_len + 1)]]
    kw = dict(max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=None, unroll_layers=unroll_layers,
              mesh=mesh)
    ar_args, ar_static = generate.prepare_ar_inputs(spec.target, prompt, **kw)
    sp_args, sp_static = loop.prepare_spec_inputs(spec.target, drafter, prompt, **kw)
    return {"ar": generate.generate_padded_jit.trace(target.params, *ar_args, **ar_static),
            "speculative": loop.speculative_padded_jit.trace(target, dp, *sp_args, **sp_static)}
