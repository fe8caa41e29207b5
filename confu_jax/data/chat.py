"""Tokenizer + chat template for a checkpoint, and the assistant loss mask training reads.

``ChatTokenizer.load(source)`` accepts what ``confu_jax.weights.load_model`` accepts: an asset
name, a ``.gguf`` file (the byte-level BPE is rebuilt from the GGUF metadata with the
pre-tokenizer its ``tokenizer.ggml.pre`` names) or a Hugging Face directory (``tokenizer.json``
+ ``tokenizer_config.json`` / ``chat_template.jinja``). Templates render in a sandboxed jinja2
environment with the globals transformers provides, so a checkpoint's own template produces the
same text it does under ``apply_chat_template``.

The assistant mask is template-agnostic: the text the model must produce for assistant turn i is
exactly what ``render(messages[:i+1])`` adds after ``render(messages[:i], add_generation_prompt=
True)`` -- that is what it generates at inference. The mask keeps that span up to and including
its end-of-turn special token (``<|im_end|>``, ``<|eot_id|>``) and maps it to tokens of the
*whole* rendered conversation by character offsets, so ids are identical to ``encode(render(...))``.
Templates that render earlier turns differently from how they were generated (Qwen3 drops the
reasoning block of every assistant turn before the last question, and with ``enable_thinking``
false puts an empty ``<think>\n\n</think>\n\n`` in the generation prompt) are not prefix-stable:
there the turn is located in the whole rendering by what changes with its content (``_locate``),
so training sees the conversation as the target sees it when answering its last turn.

Template kwargs (``template_kwargs``: ``{"enable_thinking": false}`` for Qwen3, ``date_string`` for
Llama-3.x) are held by the tokenizer and reach every render; a kwarg the template never reads is
refused when it is set (``jinja2.meta``), since a misspelt switch would otherwise change nothing,
silently. ``template_record()`` names the template (sha256 of its text) and the kwargs, for the
records and manifests of data rendered with them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from confu_jax import storage
from confu_jax.assets import resolve_model_path
from confu_jax.weights.errors import CheckpointError

# Pre-tokenizer split regexes by GGUF ``tokenizer.ggml.pre`` (as llama.cpp names them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3")
_GPT2_PRE = (None, "default", "gpt2")
_SMOLLM_PRE = ("smollm",)
SUPPORTED_GGUF_PRE = tuple(p for p in _GPT2_PRE if p) + _SMOLLM_PRE + _LLAMA3_PRE

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(pre: Optional[str], path: str):
    """(pre-tokenizer, ignore_merges) reproducing the tokenizer the merges were trained with."""
    if pre in _SMOLLM_PRE:  # SmolLM/SmolLM2 tokenizer.json: every digit its own word
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in _LLAMA3_PRE:  # Llama-3 tokenizer.json (tiktoken regex; whole-word vocab hits skip merges)
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    raise CheckpointError(
        f"{path}: tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: {list(SUPPORTED_GGUF_PRE)}"
    )


def _token_str(v) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the checkpoint's chat template and special tokens."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: Optional[str],
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        pad_token: Optional[str] = None,
        unk_token: Optional[str] = None,
        extra_eos_ids: Sequence[int] = (),
        source: str = "<tokenizer>",
        template_kwargs: Optional[Mapping] = None,
    ):
        self.tokenizer = tokenizer
        self.source = source
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        # Same vocabulary without a post-processor, for character offsets: a ByteLevel
        # post-processor with trim_offsets would shrink offsets of tokens starting with spaces.
        self._offsets_tok = Tokenizer.from_str(tokenizer.to_str())
        self._offsets_tok.post_processor = None
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        self._template = _compile(chat_template) if chat_template else None
        self.template_kwargs: dict = {}
        self.set_template_kwargs(template_kwargs)
        eos = [self.token_id(eos_token)] if eos_token else []
        eos += list(extra_eos_ids)
        eot = self._end_of_turn_id() if self._template is not None else None
        if eot is not None:
            eos.append(eot)
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: str, template_kwargs: Optional[Mapping] = None) -> "ChatTokenizer":
        """From an asset name, a ``.gguf`` file or a Hugging Face directory; ``template_kwargs`` reach
        every render of its chat template (checked against the variables the template reads)."""
        path = resolve_model_path(source)
        if storage.isdir(path):
            return cls.from_hf_dir(path, template_kwargs)
        if path.endswith(".gguf"):
            return cls.from_gguf(path, template_kwargs)
        raise CheckpointError(f"tokenizer source {source!r} -> {path!r}: expected a .gguf file or a directory")

    @classmethod
    def from_gguf(cls, path: str, template_kwargs: Optional[Mapping] = None) -> "ChatTokenizer":
        from confu_jax.weights.gguf import GGUFFile

        g = GGUFFile(path)
        model = g.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(
                f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2': SmolLM2, Llama-3) is supported"
            )
        tokens = g.require("tokenizer.ggml.tokens")
        merges = g.require("tokenizer.ggml.merges")
        types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre, ignore_merges = _pre_tokenizer(g.get("tokenizer.ggml.pre"), path)
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            ignore_merges=ignore_merges,
            fuse_unk=False,
            byte_fallback=False,
        )
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        # Control tokens (<|im_end|>, <|eot_id|>) match whole in text, as in llama.cpp and HF.
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL
        ])
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED
        ])

        def tok_at(key):
            i = g.get(key)
            return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

        eot = g.get("tokenizer.ggml.eot_token_id")
        return cls(
            tok,
            chat_template=g.get("tokenizer.chat_template"),
            bos_token=tok_at("tokenizer.ggml.bos_token_id"),
            eos_token=tok_at("tokenizer.ggml.eos_token_id"),
            pad_token=tok_at("tokenizer.ggml.padding_token_id"),
            unk_token=tok_at("tokenizer.ggml.unknown_token_id"),
            extra_eos_ids=() if eot is None else (int(eot),),
            source=path,
            template_kwargs=template_kwargs,
        )

    @classmethod
    def from_hf_dir(cls, directory: str, template_kwargs: Optional[Mapping] = None) -> "ChatTokenizer":
        tj = os.path.join(directory, "tokenizer.json")
        if not storage.isfile(tj):
            raise CheckpointError(f"{directory}: no tokenizer.json (expected a Hugging Face tokenizer directory)")
        tok = Tokenizer.from_str(storage.read_text(tj))  # a local or gs:// file
        cfg = {}
        tc = os.path.join(directory, "tokenizer_config.json")
        if storage.isfile(tc):
            with storage.open(tc) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_file = os.path.join(directory, "chat_template.jinja")  # transformers >= 4.43 saves it here
        if template is None and storage.isfile(jinja_file):
            with storage.open(jinja_file) as f:
                template = f.read()
        extra = []
        gen = os.path.join(directory, "generation_config.json")
        if storage.isfile(gen):  # Llama-3 instruct: [<|end_of_text|>, <|eom_id|>, <|eot_id|>]
            with storage.open(gen) as f:
                e = json.load(f).get("eos_token_id")
            extra = [e] if isinstance(e, int) else list(e or [])
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            unk_token=_token_str(cfg.get("unk_token")),
            extra_eos_ids=extra,
            source=directory,
            template_kwargs=template_kwargs,
        )

    def save(self, directory: str) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` that transformers' AutoTokenizer reads."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": self.chat_template,
               "bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
               "unk_token": self.unk_token, "add_bos_token": False, "clean_up_tokenization_spaces": False}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)

    # ------------------------------------------------------------------ ids

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> Optional[int]:
        return self.token_id(self.bos_token)

    @property
    def pad_id(self) -> Optional[int]:
        """Padding id: the declared pad token, else the first end-of-sequence id."""
        pid = self.token_id(self.pad_token)
        return pid if pid is not None else (self.eos_ids[0] if self.eos_ids else None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        """Ids of ``text``; special-token strings in it (``<|im_end|>``) become their single ids.
        No BOS unless ``add_special_tokens`` (chat templates write their own)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def set_template_kwargs(self, template_kwargs: Optional[Mapping]) -> None:
        """Extra variables for every render of the chat template (``{"enable_thinking": false}``).

        Why checked here: jinja treats a variable nobody passed as undefined, so a kwarg the template
        never reads (a misspelling, another model's switch) would change nothing, silently; it is
        refused in one line naming it and the variables the template does read."""
        kwargs = dict(template_kwargs or {})
        if kwargs and self._template is None:
            raise ValueError(f"{self.source}: chat template kwargs {sorted(kwargs)} given, but the tokenizer has "
                             "no chat template to pass them to")
        reserved = sorted(k for k in kwargs if k in _PER_RENDER)
        if reserved:
            raise ValueError(f"chat template kwarg {reserved[0]!r} is set per render by the caller; expected other "
                             f"variables of the template: {', '.join(self.template_variables)}")
        unused = sorted(k for k in kwargs if k not in self.template_variables)
        if unused:
            raise ValueError(f"chat template kwarg {unused[0]!r} is not used by the chat template of {self.source}; "
                             f"it uses: {', '.join(self.template_variables) or '(no variables)'}")
        self.template_kwargs = kwargs

    @property
    def template_variables(self) -> tuple:
        """The variables the chat template reads from its caller (``jinja2.meta``; the environment's
        own globals such as ``raise_exception`` left out), sorted."""
        if self._template is None:
            return ()
        env = self._template.environment
        ast = env.parse(self.chat_template)
        return tuple(sorted(v for v in jinja2.meta.find_undeclared_variables(ast) if v not in env.globals))

    def template_record(self) -> dict:
        """Which template and kwargs render this tokenizer's chats: ``{"sha256": <of the template
        text>, "kwargs": {...}}``, stored with data rendered by it (generated records, manifests)."""
        sha = hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest() if self.chat_template else None
        return {"sha256": sha, "kwargs": dict(self.template_kwargs)}

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        """The template's text for ``messages``; the tokenizer's ``template_kwargs`` reach it, and
        ``kwargs`` (per call) win over them."""
        if self._template is None:
            raise CheckpointError(f"{self.source}: no chat template (tokenizer_config.json chat_template / GGUF tokenizer.chat_template)")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token, "unk_token": self.unk_token, **self.template_kwargs, **kwargs}
        return self._template.render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context)

    def encode_prompt(self, messages: Sequence[dict], **template_kwargs) -> list:
        """Ids of the prompt the template gives for answering after ``messages``:
        ``encode(render(messages, add_generation_prompt=True))``. What a turn is generated from (no
        assistant mask, so earlier turns may be rendered any way the template likes)."""
        return self.encode(self.render(messages, add_generation_prompt=True, **template_kwargs))

    def assistant_spans(self, messages: Sequence[dict], **template_kwargs) -> list:
        """Character spans [start, end) of each assistant turn in ``render(messages)``: what the model
        generates after the generation prompt, through the turn's last special token."""
        return self._spans(messages, self.render(messages, **template_kwargs), template_kwargs)

    def _spans(self, messages: Sequence[dict], full: str, template_kwargs: dict) -> list:
        """Each assistant turn's span in ``full``. A turn rendered alone as its conversation renders it
        (prefix-stable) spans what ``render(messages[:i+1])`` adds after the generation prompt; any
        other turn is located in ``full`` (``_locate``). A turn whose text the template drops has none."""
        spans = []
        lo = 0  # spans are disjoint and in order: each is searched after the one before
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            if not any(p.get("role") == "user" for p in messages[:i]):
                raise ValueError(
                    f"{self.source}: message {i} is an assistant turn before any user turn: it answers no prompt, "
                    "so it has no span to train on (expected a user turn first; data.formats drops such turns)")
            head = self.render(messages[:i], add_generation_prompt=True, **template_kwargs)
            upto = self.render(messages[: i + 1], **template_kwargs)
            if upto.startswith(head) and full.startswith(upto) and len(head) >= lo:
                span = (len(head), len(head) + self._through_last_special(upto[len(head):]))
            else:
                span = self._locate(messages, i, full, head, upto, template_kwargs, lo)
            if span is not None:
                spans.append(span)
                lo = span[1]
        return spans

    def _through_last_special(self, text: str) -> int:
        """Length of ``text`` through its last special token (the end of turn), else all of it: the
        separator after it (ChatML's "\n") is template text the model is given, not generates."""
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        last = [off for tid, off in zip(enc.ids, enc.offsets) if self._is_special(tid)]
        return last[-1][1] if last else len(text)

    def _locate(self, messages, i: int, full: str, head: str, upto: str, template_kwargs: dict, lo: int):
        """Span of assistant message ``i`` in ``full`` when the template renders it there otherwise than
        after its own generation prompt (Qwen3's earlier turns lose their reasoning), or None when the
        template drops its text.

        Content: the part of ``full`` that changes when only this message's content does (rendered
        with "a" and with "b" instead: one of them differs from its first and last characters).
        Start: right after the turn's generation prompt if the template wrote that prompt between the
        previous span and the content (the generated text then starts there, e.g. a reasoning block
        before the answer), else at the content (the template re-rendered the turn's header). End:
        through the turn's end-of-turn token (the last special token the turn rendered alone ends
        with) when nothing but template text lies between it and the content."""
        content = None
        for x in ("a", "b"):
            alt = [*messages[:i], {**messages[i], "content": x}, *messages[i + 1:]]
            other = self.render(alt, **template_kwargs)
            if other == full:
                continue
            p = _common_prefix(full, other)
            e = len(full) - _common_suffix(full, other, min(len(full), len(other)) - p)
            content = (p, e) if content is None else (min(content[0], p), max(content[1], e))
        if content is None:
            return None
        c0, c1 = content
        if c0 < lo:
            raise ValueError(f"{self.source}: assistant message {i} renders at character {c0}, inside the turn before "
                             f"it (which ends at {lo}); expected each turn's text after the previous one's")
        prompt = head[_common_prefix(head, self.render(messages[:i], **template_kwargs)):]
        at = full.rfind(prompt, lo, c0) if prompt else -1
        start = at + len(prompt) if at >= 0 else c0
        end = c1
        g0 = _common_prefix(head, upto)
        eot = self._last_special_text(upto[g0:])
        if eot:
            at = full.find(eot, c1)
            if at >= 0 and self._last_special_text(full[c1:at]) is None:
                end = at + len(eot)
        return start, end

    def _last_special_text(self, text: str) -> Optional[str]:
        """The text of the last special token in ``text`` (None when it has none)."""
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        last = [off for tid, off in zip(enc.ids, enc.offsets) if self._is_special(tid)]
        return text[last[-1][0]:last[-1][1]] if last else None

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, **template_kwargs):
        """``(ids, assistant_mask)``: ids == ``encode(render(messages, add_generation_prompt))``;
        mask True on every token that overlaps an assistant turn's content or its end-of-turn token.
        ``template_kwargs`` reach the template (e.g. ``date_string`` for Llama-3.x) on top of the
        tokenizer's own."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        full = self.render(messages, **template_kwargs) if add_generation_prompt else text
        if not text.startswith(full):
            raise ValueError(f"{self.source}: the generation prompt rewrites the conversation before it")
        spans = self._spans(messages, full, template_kwargs)
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        mask = [any(s < b and e > a for a, b in spans) for s, e in enc.offsets]
        return list(enc.ids), mask

    def _is_special(self, token_id: int) -> bool:
        return self.tokenizer.id_to_token(token_id) in self._special

    def _end_of_turn_id(self) -> Optional[int]:
        """The special token that closes an assistant turn under this template, if any."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            spans = self.assistant_spans(probe)
        except Exception:  # template needs other inputs (tools, system...); end-of-turn stays unknown
            return None
        a, b = spans[0]
        ids = self._offsets_tok.encode(self.render(probe)[a:b], add_special_tokens=False).ids
        return ids[-1] if ids and self._is_special(ids[-1]) else None


# Variables every render sets from its arguments, never from template kwargs.
_PER_RENDER = ("messages", "add_generation_prompt")


def parse_template_kwargs(text: str, what: str = "--chat_template_kwargs") -> dict:
    """A JSON object (a flag's or config field's text, ``'{"enable_thinking": false}'``) -> dict; ''
    -> {}. One syntax for every command and the training config, so the same string works in each."""
    text = (text or "").strip() if isinstance(text, str) else text
    if not text:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}={text!r} is not JSON ({e.msg} at character {e.pos}); expected an object such as "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}={text!r} is a JSON {type(value).__name__}; expected an object such as "
                         "'{\"enable_thinking\": false}'")
    return value


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: str, b: str, limit: int) -> int:
    """Length of the longest common suffix of ``a`` and ``b``, at most ``limit``."""
    i = 0
    while i < limit and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (jinja's default would turn '<' into \u003c)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    """Same environment as transformers' ``apply_chat_template``: templates are untrusted code."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
