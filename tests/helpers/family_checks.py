"""The two loop checks every drafter family's tests make, written once.

* ``assert_sampling_is_lossless``: at T = 1 the speculative loop's output must be distributed as the
  target's own samples. Three new tokens from one prompt, sampled ``n_per × reps`` times, pass the
  chi-square test against the target's exact joint over those tokens (p > 1e-3); drafts must have
  been accepted, or the test would say nothing about the drafter's q. The 25,000-row batches run the
  scanned-layer program (``unroll_layers=False``: XLA's dots), not the CPU decode default of unrolled layers
  through the few-row matmul (``kernels.cpu_matmul``), which is built for a handful of rows and made each
  batch ~1.5x slower: which program multiplies does not change what the acceptance rules sample, the greedy
  tests check the default program token for token against AR, and ``test_spec_loop``'s chi-squares keep it.
* ``assert_sharded_equals_single_device``: a decode on a ``data × tensor`` mesh emits the single-device
  tokens (and, for drafters whose passes do not depend on the mesh, the same accepted counts).
"""

import numpy as np

from confu_jax.decode import loop, sharded
from confu_jax.decode.stopping import StopReason
from tests.helpers.loop_fixtures import chi_square_pvalue, exact_joint, generated_rows

CHI_SQUARE_PROMPT = (1, 3, 1, 3, 2, 1)


def assert_sampling_is_lossless(spec, target_params, params, drafter, *, prompt=CHI_SQUARE_PROMPT,
                                temperature: float = 1.0, top_p: float = 1.0, n_per: int = 25_000,
                                reps: int = 4, seed: int = 300):
    prompt = list(prompt)
    joint = exact_joint(spec, target_params, prompt, temperature, top_p)
    samples = []
    for r in range(reps):
        res = loop.generate_speculative(params.target, drafter, params.drafter_params, [prompt] * n_per,
                                        max_new_tokens=3, eos_ids=(),
                                        temperature=temperature, top_p=top_p, seed=seed + r, min_bucket=8,
                                        unroll_layers=False)
        assert np.all(np.asarray(res.n_generated_b) == 3)
        samples.append(np.asarray(res.tokens_bn)[:, :3])
        assert np.asarray(res.accept_log_bi).max() > 1  # drafts were accepted
    p = chi_square_pvalue(np.concatenate(samples), joint, n_per * reps)
    assert p > 1e-3, p


def assert_sharded_equals_single_device(target, drafter_params, drafter, prompts, *, mesh: str = "data=2,tensor=2",
                                        max_new_tokens: int = 16, same_accepts: bool = True):
    single = loop.generate_speculative(target, drafter, drafter_params, prompts, max_new_tokens=max_new_tokens,
                                       eos_ids=())
    out = loop.generate_speculative(target, drafter, drafter_params, prompts, max_new_tokens=max_new_tokens, eos_ids=(),
                                    mesh=sharded.parse_mesh(mesh))
    assert generated_rows(out, len(prompts)) == generated_rows(single, len(prompts))
    if same_accepts:
        np.testing.assert_array_equal(np.asarray(out.accept_log_bi), np.asarray(single.accept_log_bi))
    assert np.all(np.asarray(out.stop_reason_b) == StopReason.MAX_NEW_TOKENS)
