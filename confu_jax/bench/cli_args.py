"""The benchmark's command-line forms: budget lists and METHOD=WORKDIR head lists, with errors
that show an accepted example."""

from __future__ import annotations

# --layers: the target's layer schedule in every decode program (BenchSetup.unroll_layers)
LAYER_SCHEDULES = {"auto": None, "scan": False, "unroll": True}
LAYERS_HELP = ("the target's layers in every decode program: one scan (scan), per-layer weight buffers (unroll), or the "
               "backend's default (auto: unroll on CPU, scan elsewhere). Same outputs; compile time and step cost "
               "differ by host (docs/benchmarks.md)")

# --attention_impl (launch.generate, launch.decode_bench): the target's attention in every decode program
ATTENTION_CHOICES = ("xla", "pallas")
ATTENTION_HELP = ("the target's attention in every decode program (LlamaConfig.attention_impl): xla (every backend) "
                  "or pallas (the tree-attention kernel for verification passes, docs/DESIGN.md section 6; a CUDA GPU "
                  "only: refused elsewhere, since on CPU the kernel runs only under Pallas' interpreter, a test mode)")


def decode_attention_impl(impl: str, backend: str | None = None) -> str:
    """``--attention_impl`` checked against ``backend`` (default: JAX's) -> the ``LlamaConfig.attention_impl``
    to decode with. The kernel's own rule decides (``kernels.tree_attention.resolve_attention_impl``:
    'pallas' compiles for CUDA GPUs only); the interpreted kernel is not offered here, because on CPU
    it is a test instrument many times slower than ``xla``, not a way to decode."""
    from confu_jax.kernels.tree_attention import resolve_attention_impl

    if impl not in ATTENTION_CHOICES:
        raise ValueError(f"--attention_impl {impl!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    try:
        return resolve_attention_impl(impl, backend)
    except ValueError:
        import jax

        raise ValueError(f"--attention_impl {impl}: the tree-attention kernel needs a CUDA GPU, and this backend "
                         f"is {backend or jax.default_backend()!r}; use --attention_impl xla (on CPU the kernel "
                         "runs only under Pallas' interpreter, a test mode)") from None


def parse_budgets(text: str) -> list[str]:
    """``chain:4,dynamic:6,8,30,auto`` -> ['chain:4', 'dynamic:6,8,30', 'auto'] (a plan's numbers
    continue it; a part with ':' or 'auto' starts the next one). Each plan must be one that some
    drafter family reads (``decode.families``: ``lookup:4,2`` is a lookup plan only)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if ":" in part or part == "auto":
            out.append(part)
        elif out and out[-1] != "auto":
            out[-1] += "," + part
        else:
            raise ValueError(f"--budgets {text!r}: {part!r} does not continue a plan; expected e.g. "
                             "chain:4,dynamic:6,8,30,auto")
    for b in out:
        if b != "auto" and not plan_families(b):
            from confu_jax.decode.plans import parse_plan

            parse_plan(b)  # raises with the accepted forms
    return out


def plan_families(plan: str) -> tuple:
    """The drafter families whose plan text ``plan`` is (``head``, ``lookup``, ``hybrid``,
    ``draft_model``, ``sd2``, ``medusa``, ``mlp_speculator``, ``mtp``, ``dflash``); a benchmark runs each method only under
    the budgets its family reads."""
    from confu_jax.decode.families import FAMILIES

    fams = []
    for name, family in FAMILIES.items():
        try:
            family.parse(plan)
            fams.append(name)
        except ValueError:
            pass
    return tuple(fams)


def parse_auto_candidates(text: str) -> dict:
    """Budget auto's candidate plans: ``chain:2,chain:3,dynamic:4,4,8`` (every family measures those it
    reads) or per family, ``head=chain:2,dynamic:4,4,8;lookup=chain:2,lookup:4,2`` -> {family or None:
    (plan, ...)}; a family not named keeps its record's defaults (``decode.families``)."""
    from confu_jax.decode.families import FAMILIES

    if "=" not in text:
        return {None: tuple(parse_budgets(text))}
    out = {}
    for group in (g.strip() for g in text.split(";") if g.strip()):
        family, eq, plans = group.partition("=")
        if not eq or family not in FAMILIES:
            raise ValueError(f"--auto_candidates: {group!r} is not FAMILY=PLAN,... with FAMILY one of "
                             f"{sorted(FAMILIES)}")
        out[family] = tuple(parse_budgets(plans))
    return out


def parse_heads(text: str) -> dict:
    """``eagle3=DIR,confu=DIR`` -> {'eagle3': 'DIR', 'confu': 'DIR'}."""
    out = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, eq, path = part.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--heads: {part!r} is not METHOD=WORKDIR (e.g. eagle3=runs/smollm2_eagle3)")
        out[name] = path
    return out
