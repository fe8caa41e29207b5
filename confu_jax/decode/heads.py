"""Pair a loaded target with a draft head for speculative decoding: trained, or random for checks.

A random head proposes near-uniform tokens, so τ stays near 1 — but the output must still be the
target's (losslessness does not depend on the draft), which makes it the cheapest end-to-end check
of a decoding path. Random heads use the whole target vocabulary as draft vocabulary (identity
d2t), so no token-frequency data is needed. Trained heads come from ``launch.train`` workdirs
(``confu_jax.runs.heads``) or, for EAGLE-3, from the official / SGLang / SpecForge or speculators
(vLLM) formats (``confu_jax.weights.eagle3_formats``), and are checked against their target.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax import storage
from confu_jax.decode.spec_params import DrafterParams, SpecParams, Target, spec_params, split
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.params import init_trainable
from confu_jax.models.registry import get_method
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.models.vocab_map import identity_draft_vocab
from confu_jax.runs.head_release import is_head_release, verify_head_release
from confu_jax.runs.heads import check_head_target, load_trained_head, target_fingerprint
from confu_jax.weights.eagle3_formats import bind_to_target, detect_format, load_head


class DecodeHead(NamedTuple):
    """A family's loaded drafter weights beside the target: ``target`` and ``drafter_params`` are what
    ``decode.loop.generate_speculative`` takes; ``spec`` / ``params`` the joined form
    (``spec_params.join``) a cost model or a training run reads."""

    spec: ModelSpec
    params: SpecParams  # target + trainable + draft vocab
    trained: bool
    source: str  # the workdir, or 'random (seed N)'

    @property
    def target(self) -> Target:
        return split(self.spec, self.params)[0]

    @property
    def drafter_params(self) -> DrafterParams:
        return split(self.spec, self.params)[1]


def _speculative_method(method: str):
    m = get_method(method)
    if not m.needs_head:
        raise ValueError(f"method {method!r} does not decode with a draft head")
    return m


def model_free(target_cfg: LlamaConfig, target_params: dict) -> DecodeHead:
    """What a model-free drafter (prompt lookup) decodes with: the target alone (no head)."""
    spec = ModelSpec(target_cfg)
    return DecodeHead(spec, SpecParams(target=target_params, draft={}, confu={}, draft_vocab={}), True,
                      "model-free (no head)")


def random_head(method: str, target_cfg: LlamaConfig, target_params: dict, seed: int = 0,
                draft_vocab_size: Optional[int] = None) -> DecodeHead:
    """An untrained head (τ ≈ 1): lossless checks and cost measurements. ``draft_vocab_size``
    (default: the target's) keeps the first ids — a trained head's draft LM head has that many rows."""
    variant = _speculative_method(method).variants[0]
    v_draft = target_cfg.vocab_size if draft_vocab_size is None else draft_vocab_size
    if not 0 < v_draft <= target_cfg.vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target_cfg.vocab_size}], got {v_draft}")
    head = HeadConfig(variant=variant, draft_vocab_size=v_draft)
    spec = ModelSpec(target_cfg, head)
    trainable = jax.device_get(init_trainable(spec, jax.random.PRNGKey(seed)))
    vocab = identity_draft_vocab(target_cfg.vocab_size, v_draft)
    return DecodeHead(spec, spec_params(target_params, trainable, vocab), False, f"random (seed {seed})")


def trained_head(method: str, workdir: str, target_cfg: LlamaConfig, target_params: dict,
                 step: Optional[int] = None, target_source: str = "the loaded target") -> DecodeHead:
    """The head of a ``launch.train`` workdir on this target (architecture and weights checked)."""
    accepted = _speculative_method(method).variants
    workdir = storage.absolute(os.path.expanduser(workdir))
    if detect_format(workdir) is not None:
        return imported_head(method, workdir, target_cfg, target_params)
    _check_release(workdir, target_params)  # a released ConFu head (trainable-tree export)
    h = load_trained_head(workdir, step)
    if h.spec.head.variant not in accepted:
        raise ValueError(f"{workdir} holds a {h.spec.head.variant!r} head; --method {method} needs one of "
                         f"{accepted}")
    check_head_target(h, workdir, target_cfg, target_params, target_source)
    spec = ModelSpec(target_cfg, h.spec.head)
    vocab = {"d2t": np.asarray(h.draft_vocab["d2t"], np.int32), "t2d": np.asarray(h.draft_vocab["t2d"])}
    return DecodeHead(spec, spec_params(target_params, h.trainable, vocab), True, f"{workdir} (step {h.step})")


def _check_release(directory: str, target_params) -> None:
    """A released head (releases/heads/...): its files' hashes and its target, before loading."""
    if not is_head_release(directory):
        return
    manifest = verify_head_release(directory)
    want = (manifest.get("target") or {}).get("fingerprint")
    if want and want != target_fingerprint(target_params):
        raise ValueError(f"{directory} was trained against a target with weights fingerprint {want[:16]}... "
                         f"({manifest['target'].get('source')}); the loaded target differs")


def imported_head(method: str, directory: str, target_cfg: LlamaConfig, target_params: dict) -> DecodeHead:
    """An EAGLE-3 head in the official (SGLang / SpecForge) or speculators (vLLM) format
    (``weights.eagle3_formats``), checked against this target: width, heads, vocabulary, taps."""
    accepted = _speculative_method(method).variants
    _check_release(directory, target_params)
    imp = load_head(directory)
    if imp.head.variant not in accepted:
        raise ValueError(f"{directory} holds an EAGLE-3 head ({imp.fmt} format); --method {method} needs one of "
                         f"{accepted}: decode it with --method eagle3, or train ConFu from it (init_from)")
    spec, trainable, vocab = bind_to_target(imp, target_cfg, target_params)
    return DecodeHead(spec, spec_params(target_params, trainable, vocab), True, f"{directory} ({imp.fmt} format)")


def draft_model_head(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, *,
                     steered: bool = False, target_tokenizer=None, target_source: str = "the loaded target"
                     ) -> DecodeHead:
    """What an independent draft model (family ``draft_model``) or SD² (family ``sd2``) decodes with
    (``decode.draft_model``; sources: ``runs.draft_models``): ``source`` = ``self:N`` (the target's first
    N layers; default a quarter of them), an asset / GGUF / Hugging Face directory sharing the target's
    tokenizer (checked against ``target_tokenizer``, default loaded from ``target_source``), or a
    trained ``launch.train`` SD² workdir: ``sd2`` decodes its fine-tuned drafter with its steering;
    ``draft_model`` decodes the fine-tuned drafter alone (the distilled baseline, a run with
    ``config.sd2.steer`` False, or a steered run's drafter without its steering, an ablation). SD²
    without a trained run gets the paper's initialisation (W_s = 0): it then drafts exactly as the
    unsteered model (``trained`` False)."""
    from confu_jax.models.early_exit import default_self_layers
    from confu_jax.models.steering import init_steering
    from confu_jax.runs import draft_models

    source = source or f"self:{default_self_layers(target_cfg)}"
    kw = dict(target_tokenizer=target_tokenizer, target_source=target_source)
    trained = True
    if draft_models.is_sd2_workdir(source):
        run = draft_models.load_sd2_run(source, target_cfg, target_params, **kw)
        if steered and run.steering is None:
            raise ValueError(f"{source} is a distilled run (config.sd2.steer=False): it has no steering to decode "
                             "--method sd2 with; decode its drafter with --method draft_model")
        d, steering = run.drafter, (run.steering if steered else None)
    else:
        d = draft_models.load_drafter(source, target_cfg, **kw)
        steering = None
        if steered:
            steering, trained = jax.device_get(init_steering(target_cfg.d_model, 3, d.cfg)), False
    draft = {} if d.params is None else {"model": d.params}
    if steering is not None:
        draft["steering"] = steering
    spec = ModelSpec(target_cfg, draft_model=d.cfg)
    desc = d.source + ("" if not steered else " + SD² steering" + ("" if trained else " (untrained: W_s = 0)"))
    return DecodeHead(spec, SpecParams(target=target_params, draft=draft, confu={}, draft_vocab={}), trained, desc)


def medusa_head(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, seed: int = 0,
                target_source: str = "the loaded target", num_heads: int = 4) -> DecodeHead:
    """What Medusa (family ``medusa``) decodes with: the heads of a ``launch.train`` Medusa workdir
    (``runs.medusa``, target checked), of a FasterDecoding directory (``medusa_lm_head.safetensors``
    / ``.pt`` + config.json: ``weights.medusa_format``, width and vocabulary checked), or, with no
    source, the reference initialisation (ResBlock W = 0, LM heads = the target's; ``trained`` False)."""
    import jax.numpy as jnp

    from confu_jax.models.medusa import config_of, init_medusa
    from confu_jax.runs.medusa import is_medusa_workdir, load_medusa_run
    from confu_jax.weights.medusa_format import is_medusa_dir, load_medusa_dir

    if source is None:
        from confu_jax.models.target import lm_head_matrix
        w, axis = lm_head_matrix(target_cfg, target_params)
        heads = jax.device_get(init_medusa(jax.random.PRNGKey(seed), num_heads, 1, jnp.asarray(w), axis))
        trained, desc = False, f"Medusa reference initialisation ({num_heads} heads, seed {seed})"
    else:
        path = storage.absolute(os.path.expanduser(source))
        if is_medusa_workdir(path):
            run = load_medusa_run(path, target_cfg, target_params, target_source=target_source)
            heads, desc = run.heads, run.source
        elif is_medusa_dir(path):
            imp = load_medusa_dir(path)
            heads, desc = imp.heads, f"{path} (FasterDecoding Medusa format)"
        else:
            raise ValueError(f"{source}: neither a Medusa launch.train workdir (config.json with a 'medusa' section "
                             "+ checkpoints/) nor a FasterDecoding Medusa directory (medusa_lm_head.safetensors/.pt)")
        c = config_of(heads)
        if c.d_model != target_cfg.d_model:
            raise ValueError(f"{source}: Medusa heads of width {c.d_model} cannot read a target of width "
                             f"{target_cfg.d_model}")
        if c.vocab_size < target_cfg.vocab_size:
            raise ValueError(f"{source}: Medusa heads over {c.vocab_size} tokens; the target has {target_cfg.vocab_size}")
        trained = True
    spec = ModelSpec(target_cfg)
    return DecodeHead(spec, SpecParams(target=target_params, draft={"medusa": heads}, confu={}, draft_vocab={}),
                      trained, desc)


def mlp_speculator_head(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, seed: int = 0,
                        target_source: str = "the loaded target", n_predict: int = 3) -> DecodeHead:
    """What the MLP speculator (family ``mlp_speculator``) decodes with: the stages of a ``launch.train``
    MLP speculator workdir (``runs.mlp_speculator``, target checked), of a published fms-extras / vLLM
    directory (config.json with model_type ``mlp_speculator`` + model.safetensors:
    ``weights.mlp_speculator_format``, width and vocabulary checked), or, with no source, the
    reference initialisation (``n_predict`` stages of the target's width, N(0, 1/sqrt(d)) weights;
    ``trained`` False)."""
    from confu_jax.models.mlp_speculator import config_of, init_mlp_speculator, make_config
    from confu_jax.runs.mlp_speculator import is_mlp_speculator_workdir, load_mlp_speculator_run
    from confu_jax.weights.mlp_speculator_format import is_mlp_speculator_dir, load_mlp_speculator_dir

    if source is None:
        c = make_config(n_predict, target_cfg.d_model, target_cfg.vocab_size)
        params = jax.device_get(init_mlp_speculator(jax.random.PRNGKey(seed), c))
        trained, desc = False, f"MLP speculator reference initialisation ({n_predict} stages, seed {seed})"
    else:
        path = storage.absolute(os.path.expanduser(source))
        if is_mlp_speculator_workdir(path):
            run = load_mlp_speculator_run(path, target_cfg, target_params, target_source=target_source)
            params, desc = run.params, run.source
        elif is_mlp_speculator_dir(path):
            params, desc = load_mlp_speculator_dir(path).params, f"{path} (fms / vLLM mlp_speculator format)"
        else:
            raise ValueError(f"{source}: neither an MLP speculator launch.train workdir (config.json with an "
                             "'mlp_speculator' section + checkpoints/) nor a published MLP speculator directory "
                             "(config.json with model_type 'mlp_speculator' + model.safetensors)")
        c = config_of(params)
        if c.emb_dim != target_cfg.d_model:
            raise ValueError(f"{source}: an MLP speculator of emb_dim {c.emb_dim} cannot read a target of width "
                             f"{target_cfg.d_model}")
        if c.vocab_size < target_cfg.vocab_size:
            raise ValueError(f"{source}: MLP speculator over {c.vocab_size} tokens; the target has "
                             f"{target_cfg.vocab_size}")
        trained = True
    spec = ModelSpec(target_cfg)
    return DecodeHead(spec, SpecParams(target=target_params, draft={"mlp_speculator": params}, confu={},
                                       draft_vocab={}), trained, desc)


def mtp_head(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, seed: int = 0,
             target_source: str = "the loaded target") -> DecodeHead:
    """What the MTP module (family ``mtp``) decodes with: the module of a ``launch.train`` MTP workdir
    (``runs.mtp``, target checked), of a DeepSeek-layout directory (config.json with
    ``num_nextn_predict_layers`` + model.safetensors: ``weights.mtp_format``; its layer must be the
    target's layer shape, and any embedding / LM head copy the target's), or, with no source, the
    untrained module (``models.mtp.init_mtp``: the target's last layer, ``trained`` False)."""
    from confu_jax.models.mtp import check_mtp_params, init_mtp
    from confu_jax.runs.mtp import is_mtp_workdir, load_mtp_run
    from confu_jax.weights.mtp_format import check_shared, is_mtp_dir, load_mtp_dir

    if source is None:
        params = jax.device_get(init_mtp(jax.random.PRNGKey(seed), target_cfg, target_params))
        trained, desc = False, f"MTP module initialisation (the target's last layer, seed {seed})"
    else:
        path = storage.absolute(os.path.expanduser(source))
        if is_mtp_workdir(path):
            run = load_mtp_run(path, target_cfg, target_params, target_source=target_source)
            params, desc = run.params, run.source
        elif is_mtp_dir(path):
            imp = load_mtp_dir(path)
            for field in ("d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "rope_theta", "rope_scaling",
                          "rms_eps"):
                if getattr(imp.block, field) != getattr(target_cfg, field):
                    raise ValueError(f"{source}: an MTP layer with {field}={getattr(imp.block, field)} cannot run "
                                     f"as a layer of the target ({field}={getattr(target_cfg, field)})")
            check_shared(imp, target_cfg, target_params)
            params, desc = imp.params, f"{path} (DeepSeek-layout MTP, layer {imp.layer_index})"
        else:
            raise ValueError(f"{source}: neither an MTP launch.train workdir (config.json with an 'mtp' section + "
                             "checkpoints/) nor a DeepSeek-layout MTP directory (config.json with "
                             "num_nextn_predict_layers + model.safetensors)")
        trained = True
    check_mtp_params(params, target_cfg)
    spec = ModelSpec(target_cfg)
    return DecodeHead(spec, SpecParams(target=target_params, draft={"mtp": params}, confu={}, draft_vocab={}),
                      trained, desc)


def dflash_head(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, seed: int = 0,
                target_source: str = "the loaded target", num_layers: int = 3) -> DecodeHead:
    """What DFlash (family ``dflash``) decodes with: the draft of a ``launch.train`` DFlash workdir
    (``runs.dflash``, target checked), of a published z-lab DFlash directory (config.json with
    ``DFlashDraftModel`` / ``dflash_config`` + model.safetensors: ``weights.dflash_format``; its width must be
    the target's and it must read 3 target layers, this project's tap count), or, with no source, an
    untrained draft (``num_layers`` layers of the target's shape over the reference's default layers, the
    last token id as the mask; ``trained`` False). The spec carries the draft's layer config
    (``ModelSpec.draft_model``) and its taps."""
    from confu_jax.models.dflash import check_dflash_params, default_taps, draft_config, init_dflash
    from confu_jax.runs.dflash import is_dflash_workdir, load_dflash_run
    from confu_jax.weights.dflash_format import is_dflash_dir, load_dflash_dir

    if source is None:
        dcfg, taps = draft_config(target_cfg, num_layers), default_taps(target_cfg.n_layers)
        params = jax.device_get(init_dflash(jax.random.PRNGKey(seed), dcfg, len(taps)))
        mask, trained = target_cfg.vocab_size - 1, False
        desc = f"DFlash initialisation ({num_layers} layers, seed {seed})"
    else:
        path = storage.absolute(os.path.expanduser(source))
        if is_dflash_workdir(path):
            run = load_dflash_run(path, target_cfg, target_params, target_source=target_source)
            params, dcfg, taps, mask, desc = run.params, run.draft, run.taps, run.mask_token_id, run.source
        elif is_dflash_dir(path):
            imp = load_dflash_dir(path)
            if imp.draft.d_model != target_cfg.d_model:
                raise ValueError(f"{source}: a DFlash draft of width {imp.draft.d_model} cannot read a target of width "
                                 f"{target_cfg.d_model} (its block input is the target's embedding)")
            if imp.num_target_layers and imp.num_target_layers != target_cfg.n_layers:
                raise ValueError(f"{source}: a DFlash draft for a {imp.num_target_layers}-layer target; the target has "
                                 f"{target_cfg.n_layers}")
            if not imp.taps or max(imp.taps) >= target_cfg.n_layers:
                raise ValueError(f"{source}: target_layer_ids {[t - 1 for t in imp.taps]}: expected outputs of layers "
                                 f"below the last ({target_cfg.n_layers - 1}) of this {target_cfg.n_layers}-layer target")
            params, dcfg, taps, mask = imp.params, imp.draft, imp.taps, imp.mask_token_id
            dcfg = dcfg.replace(vocab_size=target_cfg.vocab_size, dtype=target_cfg.dtype,
                                param_dtype=target_cfg.param_dtype)
            desc = f"{path} (z-lab DFlash format, block {imp.block_size})"
        else:
            raise ValueError(f"{source}: neither a DFlash launch.train workdir (config.json with a 'dflash' section + "
                             "checkpoints/) nor a published DFlash directory (config.json with architectures "
                             "['DFlashDraftModel'] + model.safetensors)")
        trained = True
    check_dflash_params(params, dcfg, len(taps))
    spec = ModelSpec(target_cfg, draft_model=dcfg, tap_layers=tuple(taps))
    draft = {**params, "mask_token_id": np.int32(mask)}
    return DecodeHead(spec, SpecParams(target=target_params, draft={"dflash": draft}, confu={}, draft_vocab={}),
                      trained, desc)


def split_step(source: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """``runs/e3@64`` -> ('runs/e3', 64): a head source naming one checkpoint step of a training
    run (the points of a scaling curve; a run's latest step otherwise). A path whose last '@' is not
    followed by digits alone is returned whole."""
    if not source or "@" not in source:
        return source, None
    path, _, tail = source.rpartition("@")
    if not tail.isdigit() or not path:
        return source, None
    return path, int(tail)
