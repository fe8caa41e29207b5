"""JetSpec's ``accum_logp`` tree construction, transcribed from its reference for the equality test.

Source: hao-ai-lab/JetSpec ``jetspec/tree/baselines/accum_logp.py`` ``_build_from_topk`` (and the per-depth
top-k of ``AccumLogP.build``) at commit 2c7b3fa0 — the loop below is the reference's, with torch's
tensors replaced by Python lists (the ancestor matrices and child maps it also returns are derived from
``parents`` and are not compared). Kept as the reference wrote it: a heap of (−cum log-prob, insertion
counter, node), popping the best node and appending all its top-k children up to the budget.
"""

from __future__ import annotations

import heapq

import numpy as np


def per_depth_topk(draft_logits_dv: np.ndarray, tree_width: int):
    """``torch.topk(torch.log_softmax(draft_logits, -1), tree_width)`` per depth, as lists (ties: lower id)."""
    x = np.asarray(draft_logits_dv, np.float64)
    logp = x - np.max(x, -1, keepdims=True)
    logp = logp - np.log(np.sum(np.exp(logp), -1, keepdims=True))
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :tree_width]
    return order.tolist(), np.take_along_axis(logp, order, -1).tolist()


def build_from_topk(root_token: int, topk_tokens_cpu, topk_logprobs_cpu, budget: int):
    """(tokens, parents, depths, cum_logprobs) lists, node 0 the root (the reference's loop)."""
    D = len(topk_tokens_cpu)
    k = len(topk_tokens_cpu[0]) if D > 0 else 0
    tokens_list = [root_token]
    parents_list = [-1]
    depths_list = [0]
    cum_lp_list = [0.0]
    num_nodes = 1
    counter = 0
    heap = [(0.0, counter, 0)]
    while heap and num_nodes < budget:
        neg_cum_lp, _, node_idx = heapq.heappop(heap)
        d = depths_list[node_idx]
        if d >= D:
            continue
        children_to_add = min(k, budget - num_nodes)
        for j in range(children_to_add):
            child_token = topk_tokens_cpu[d][j]
            child_cum_lp = -neg_cum_lp + topk_logprobs_cpu[d][j]
            tokens_list.append(child_token)
            parents_list.append(node_idx)
            depths_list.append(d + 1)
            cum_lp_list.append(child_cum_lp)
            counter += 1
            heapq.heappush(heap, (-child_cum_lp, counter, num_nodes))
            num_nodes += 1
    return tokens_list, parents_list, depths_list, cum_lp_list
