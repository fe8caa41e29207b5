"""Small conversations and a data config for the grain pipeline's tests (data pipeline, packing)."""

from confu_jax.data import pipeline

MAX_LEN = 24


def conversations(n=23):
    """Small conversations of varying length; record 5's prompt alone overflows MAX_LEN."""
    convs = []
    for i in range(n):
        words = " ".join(f"w{i}_{j}" for j in range(1 + i % 4))
        user = "x " * 40 if i == 5 else f"question {i} {words}"
        convs.append(
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": f"answer {i} {words}"},
                ],
            }
        )
    return convs


def data_cfg(**kw):
    c = pipeline.default_data_config()
    c.max_length = MAX_LEN
    c.global_batch_size = 4
    c.num_threads = 0
    c.prefetch_buffer_size = 0
    c.update(kw)
    return c
