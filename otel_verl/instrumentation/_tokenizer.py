"""The decode and encode functions the trajectory JSONL gets for a rollout worker's tokenizer.

``tokenizer.decode`` of a Hugging Face fast tokenizer spends ~20 µs of Python around a
~3-6 µs call of its Rust backend (argument conversion, the clean-up switch), and the
JSONL decodes every turn's completion and the first prompt. Where the tokenizer's own
``decode`` is the stock one and does no clean-up, calling the backend with the same
plain list of ids gives the same text; anything else goes through ``tokenizer.decode``.

Both functions pickle (for the export process of :mod:`otel_verl.offload`) as their
backend-only forms: a ``tokenizers.Tokenizer`` and a flag, so the export process loads
the Rust tokenizer alone, not ``transformers`` and ``torch`` (~0.5 GB and seconds of
CPU per worker). The snapshots it decodes carry plain id lists, the backend's input.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

_DECODER_ATTR = "_otel_verl_text_decoder"
_ENCODER_ATTR = "_otel_verl_text_encoder"


def text_decoder(tokenizer: Any) -> Optional[Callable[..., str]]:
    """``decode(ids, skip_special_tokens=False) -> str``, equal to ``tokenizer.decode``
    (``None`` without a tokenizer). Chosen once per tokenizer."""
    cached = getattr(tokenizer, _DECODER_ATTR, None)  # per trajectory: the cached one, nothing made
    if cached is not None:
        return cached
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None
    return _remember(tokenizer, _DECODER_ATTR, _backend_decoder(tokenizer, decode) or decode)


def text_encoder(tokenizer: Any) -> Optional[Callable[..., Any]]:
    """``encode(text, add_special_tokens=False) -> ids``: ``tokenizer.encode`` itself,
    wrapped (when it is the stock fast one) so that it pickles as the backend alone.
    Chosen once per tokenizer."""
    cached = getattr(tokenizer, _ENCODER_ATTR, None)
    if cached is not None:
        return cached
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return None
    return _remember(tokenizer, _ENCODER_ATTR, _backend_encoder(tokenizer, encode))


def _remember(tokenizer: Any, attr: str, chosen: Any) -> Any:
    # one object per tokenizer: the export process gets each tokenizer's functions once
    try:
        setattr(tokenizer, attr, chosen)
    except Exception:  # a tokenizer that takes no attributes: choose again next time
        pass
    return chosen


def _backend_encoder(tokenizer: Any, encode: Callable[..., Any]) -> Callable[..., Any]:
    bases = _fast_bases()
    backend = getattr(tokenizer, "_tokenizer", None)
    if bases is None or backend is None or not hasattr(backend, "encode"):
        return encode
    base, fast = bases
    cls = type(tokenizer)
    stock = (
        isinstance(tokenizer, fast)
        and getattr(cls, "encode", None) is base.encode
        and getattr(cls, "_encode_plus", None) is fast._encode_plus
    )
    return BackendEncode(encode, backend, bool(getattr(tokenizer, "split_special_tokens", False))) if stock else encode


def _fast_bases() -> Optional[tuple]:
    """(PreTrainedTokenizerBase, the fast tokenizers' base class), or None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        try:  # transformers >= 5
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as FastBase
        except ImportError:
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as FastBase
    except ImportError:
        return None
    return PreTrainedTokenizerBase, FastBase


def _backend_decoder(tokenizer: Any, decode: Callable[..., str]) -> Optional[Callable[..., str]]:
    bases = _fast_bases()
    if bases is None:
        return None
    base, fast = bases
    cls = type(tokenizer)
    backend_decode = getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)
    stock = (
        isinstance(tokenizer, fast)
        and getattr(cls, "decode", None) is base.decode
        and getattr(cls, "_decode", None) is fast._decode
    )
    if not stock or backend_decode is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return BackendDecode(backend_decode, decode)


class BackendDecode:
    """The backend's decode for plain id lists, ``tokenizer.decode`` for anything else.
    Pickles as :class:`BackendOnlyDecode` (see the module docs)."""

    __slots__ = ("backend_decode", "decode")

    def __init__(self, backend_decode: Callable[..., str], decode: Callable[..., str]) -> None:
        self.backend_decode = backend_decode
        self.decode = decode

    def __call__(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if type(ids) is list:  # the agent loops' plain id lists
            try:
                return self.backend_decode(ids, skip_special_tokens=skip_special_tokens)
            except (TypeError, ValueError, OverflowError):
                pass
        return self.decode(ids, skip_special_tokens=skip_special_tokens)

    def __reduce__(self) -> tuple:
        return BackendOnlyDecode, (self.backend_decode,)


class BackendOnlyDecode:
    """A :class:`BackendDecode` in the export process: the backend for any ids."""

    __slots__ = ("backend_decode",)

    def __init__(self, backend_decode: Callable[..., str]) -> None:
        self.backend_decode = backend_decode

    def __call__(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self.backend_decode(ids if type(ids) is list else [int(i) for i in ids],
                                   skip_special_tokens=skip_special_tokens)


class BackendEncode:
    """``tokenizer.encode`` (called as it is); pickles as :class:`BackendOnlyEncode`."""

    __slots__ = ("encode", "backend", "split_special_tokens")

    def __init__(self, encode: Callable[..., Any], backend: Any, split_special_tokens: bool) -> None:
        self.encode = encode
        self.backend = backend
        self.split_special_tokens = split_special_tokens

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        return self.encode(text, add_special_tokens=add_special_tokens, **kwargs)

    def __reduce__(self) -> tuple:
        return BackendOnlyEncode, (self.backend, self.split_special_tokens)


class BackendOnlyEncode:
    """What the stock fast ``encode`` of one text does (no truncation, no padding, special
    tokens split as the tokenizer says), on the backend alone: the export process's copy."""

    __slots__ = ("backend",)

    def __init__(self, backend: Any, split_special_tokens: bool) -> None:
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        self.backend = backend

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> List[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
