"""Decode settings for ``python -m launch.generate`` (and the AR side of ``launch.decode_bench``).

Override any field on the command line, e.g. ``--config.decode.max_new_tokens=64``; the config is
locked, so a misspelt field is an error rather than a silently ignored setting. Speculative methods
add their own sections here when they land (``--method`` selects which one runs).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.decode = ml_collections.ConfigDict()
    config.decode.max_new_tokens = 256
    config.decode.temperature = 0.0  # 0 = greedy
    config.decode.top_p = 1.0  # nucleus mass; 1.0 = off
    config.decode.seed = 0
    # Prompts are right-padded to the smallest power of two >= max(length, min_bucket): a new
    # prompt length recompiles only when it crosses a power of two.
    config.decode.min_bucket = 64
    # KV-cache slots; 0 = prompt bucket + max_new_tokens (no row can run out of cache).
    config.decode.max_len = 0

    config.chat = ml_collections.ConfigDict()
    # System message prepended to the conversation; '' keeps the chat template's own default.
    config.chat.system = ""
    return config
