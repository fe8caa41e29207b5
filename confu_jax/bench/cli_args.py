"""The benchmark's command-line forms: budget lists and METHOD=WORKDIR head lists, with errors
that show an accepted example."""

from __future__ import annotations


def parse_budgets(text: str) -> list[str]:
    """``chain:4,dynamic:6,8,30,auto`` -> ['chain:4', 'dynamic:6,8,30', 'auto'] (a plan's numbers
    continue it; a part with ':' or 'auto' starts the next one). Each plan must be one that some
    drafter family reads (``decode.drafters``: ``lookup:4,2`` is a lookup plan only)."""
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
    from confu_jax.decode.drafters import parse_drafter

    fams = []
    for family, method in (("head", "eagle3"), ("lookup", "lookup"), ("hybrid", "hybrid"),
                           ("draft_model", "draft_model"), ("sd2", "sd2"), ("medusa", "medusa"),
                           ("mlp_speculator", "mlp_speculator"), ("mtp", "mtp"), ("dflash", "dflash")):
        try:
            parse_drafter(method, plan)
            fams.append(family)
        except ValueError:
            pass
    return tuple(fams)


def parse_heads(text: str) -> dict:
    """``eagle3=DIR,confu=DIR`` -> {'eagle3': 'DIR', 'confu': 'DIR'}."""
    out = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, eq, path = part.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--heads: {part!r} is not METHOD=WORKDIR (e.g. eagle3=runs/smollm2_eagle3)")
        out[name] = path
    return out
