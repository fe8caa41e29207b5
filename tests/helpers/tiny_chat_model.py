"""A tiny random Llama as a GGUF file with a ChatML template: CLI/benchmark tests go through the
same loader and tokenizer path as SmolLM2 (``load_model``, ``ChatTokenizer.load``) in seconds."""

from tests.helpers.tiny_checkpoints import hf_llama, write_gguf

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_gguf(directory, layers: int = 4, max_pos: int = 512) -> str:
    """Write ``directory/tiny.gguf`` (vocab 300, ``layers`` layers, ``max_pos`` positions) and return
    its path (8 layers, 2048 positions: the ``tiny-chat`` preset, whose EAGLE-3 taps are distinct)."""
    model = hf_llama(directory / "hf", vocab=300, layers=layers, max_pos=max_pos)
    path = str(directory / "tiny.gguf")
    write_gguf(path, model, chat_template=TEMPLATE)
    return path
