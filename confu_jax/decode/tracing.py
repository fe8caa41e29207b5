"""The decode programs traced with shape-only parameters: what a mesh compiles, asked before any
weights exist (``launch.decode_cost``, the scale tests), and the same programs compiled for hardware
that is not attached (``confu_jax.topology``). Above ``generate``, ``loop`` and ``sharded``, which it
combines; none of them imports it."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from confu_jax.decode import generate, loop
from confu_jax.decode.sharded import abstract_params
from confu_jax.devices import compiling_for, mesh_platform, platform_name


def _on_device(tree, device):
    """Shapes of ``tree`` (arrays or ShapeDtypeStructs) committed to one device."""
    s = SingleDeviceSharding(device)
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree)


def trace_loops(spec, mesh: Optional[Mesh], drafter, prompt_len: int = 8, max_new_tokens: int = 32,
                max_len: int = 128, unroll_layers: Optional[bool] = False, device=None,
                temperature: float = 0.0) -> dict:
    """The AR and speculative programs of a head's ``spec`` drafting with ``drafter`` (a
    ``decode.drafting.HeadDrafter``, or any drafter the loop takes) traced with shape-only
    parameters -> {'ar': Traced, 'speculative': Traced}; ``.lower()`` them, and ``.compile()`` for
    a topology's devices.

    On ``mesh`` (the sharded loops), or with ``mesh=None`` on one ``device`` (the loops a single
    device runs, unsharded). Traced for the platform of those devices (``devices.compiling_for``):
    a TPU or GPU topology gets the programs that hardware runs, whatever the host. ``unroll_layers``:
    False (scanned layers, the form GPU/TPU run: docs/DESIGN.md §7), True, or None (the platform's
    default)."""
    if mesh is None and device is None:
        raise ValueError("trace_loops needs a mesh or, for the unsharded loops, one device")
    if mesh is not None:
        platform = mesh_platform(mesh)
        target, dp = abstract_params(spec, mesh)
    else:
        platform = platform_name(device.platform)
        target, dp = _on_device(abstract_params(spec, _one_device_mesh(device)), device)
    prompt = [[i % spec.target.vocab_size for i in range(1, prompt_len + 1)]]
    kw = dict(max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=None, unroll_layers=unroll_layers,
              mesh=mesh, temperature=temperature)
    with compiling_for(platform):
        ar_args, ar_static = generate.prepare_ar_inputs(spec.target, prompt, **kw)
        sp_args, sp_static = loop.prepare_spec_inputs(spec.target, drafter, prompt, **kw)
        if mesh is None:
            ar_args, sp_args = _on_device(tuple(ar_args), device), _on_device(tuple(sp_args), device)
        return {"ar": generate.generate_padded_jit.trace(target.params, *ar_args, **ar_static),
                "speculative": loop.speculative_padded_jit.trace(target, dp, *sp_args, **sp_static)}


def trace_speculative(target, dp, drafter, device, prompt_len: int = 8, max_new_tokens: int = 16,
                      max_len: int = 64, temperature: float = 0.0):
    """Any family's speculative loop (``target``, ``drafter``, ``dp``: arrays or shapes, e.g. what a
    family record loads) traced unsharded on one ``device`` (a topology's, to compile for that
    hardware) -> a ``Traced`` of ``loop.speculative_padded_jit``."""
    prompt = [[1 + i % (target.config.vocab_size - 1) for i in range(prompt_len)]]
    with compiling_for(platform_name(device.platform)):
        args, static = loop.prepare_spec_inputs(target.config, drafter, prompt, max_new_tokens=max_new_tokens,
                                                max_len=max_len, eos_ids=None, temperature=temperature)
        target, dp, args = _on_device((target, dp, tuple(args)), device)
        return loop.speculative_padded_jit.trace(target, dp, *args, **static)


def _one_device_mesh(device) -> Mesh:
    return Mesh(np.array([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))


def compile_traced(traced: dict, platform: str) -> dict:
    """``{name: Traced}`` -> ``{name: Compiled}``, lowered and compiled for ``platform``."""
    with compiling_for(platform):
        return {name: tr.lower().compile() for name, tr in traced.items()}
