"""What the tests against speculators' DFlash-family models (DSpark, DFlash2) share: the draft's Qwen3 layer config
over a tiny target, random weights that act, the verifier's embedding and LM head copied in (a full-vocabulary
draft reads both from the verifier: speculators' ``load_verifier_weights``), and its training forward run at fixed
anchors (``select_anchors`` patched), whose outputs each test reads where the forward hands them to its loss."""

from __future__ import annotations

import numpy as np

from confu_jax.models.target import lm_head_matrix


def layer_config(cfg):
    """The draft's ``Qwen3Config`` (2 layers of the tiny target's width and heads, eager attention)."""
    from transformers import Qwen3Config

    tl = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)
    tl._attn_implementation = "eager"
    return tl


def speculators_config(algorithm: str, speculative_tokens: int):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return SpeculatorsConfig(
        algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
        default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))


def randomize(model, seed: int):
    """Every weight random (norm scales near 1), then the verifier's embedding and LM head; eval mode."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def verifier_weights(model, cfg, tp):
    """A full-vocabulary draft reads the verifier's embedding and LM head (speculators' load_verifier_weights)."""
    import torch

    w, axis = lm_head_matrix(cfg, tp)
    w = np.asarray(w, np.float32)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.tensor(np.asarray(tp["embed"]["embedding"], np.float32)))
        model.lm_head.weight.copy_(torch.tensor(w if axis == 0 else w.T))
    return model


def forward_at_anchors(model, input_ids, h_cat, anchors, monkeypatch):
    """speculators' training forward over ``input_ids`` / the target's taps ``h_cat`` with its anchors fixed."""
    import speculators.models.dflash.core as dcore
    import torch

    n = input_ids.shape[1]
    monkeypatch.setattr(dcore, "select_anchors", lambda loss_mask, max_anchors, block_size: (
        torch.tensor(anchors), torch.ones(len(anchors), dtype=torch.bool)))
    with torch.no_grad():
        model(hidden_states=torch.tensor(h_cat), input_ids=torch.tensor(input_ids, dtype=torch.long),
              loss_mask=torch.ones((1, n)), verifier_last_hidden_states=torch.zeros((1, n, h_cat.shape[-1] // 3)),
              document_ids=torch.zeros((1, n), dtype=torch.long), position_ids=torch.arange(n)[None],
              max_anchors=len(anchors))
