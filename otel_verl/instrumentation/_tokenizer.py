"""The decode function the trajectory JSONL gets for a rollout worker's tokenizer.

``tokenizer.decode`` of a Hugging Face fast tokenizer spends ~20 µs of Python around a
~3-6 µs call of its Rust backend (argument conversion, the clean-up switch), and the
JSONL decodes every turn's completion and the first prompt. Where the tokenizer's own
``decode`` is the stock one and does no clean-up, calling the backend with the same
plain list of ids gives the same text; anything else goes through ``tokenizer.decode``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

_CACHE_ATTR = "_otel_verl_text_decoder"


def text_decoder(tokenizer: Any) -> Optional[Callable[..., str]]:
    """``decode(ids, skip_special_tokens=False) -> str``, equal to ``tokenizer.decode``
    (``None`` without a tokenizer). Chosen once per tokenizer."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None
    cached = getattr(tokenizer, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    chosen = _backend_decoder(tokenizer, decode) or decode
    try:
        setattr(tokenizer, _CACHE_ATTR, chosen)
    except Exception:  # a tokenizer that takes no attributes: choose again next time
        pass
    return chosen


def _backend_decoder(tokenizer: Any, decode: Callable[..., str]) -> Optional[Callable[..., str]]:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        try:  # transformers >= 5
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as FastBase
        except ImportError:
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as FastBase
    except ImportError:
        return None
    cls = type(tokenizer)
    backend_decode = getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)
    stock = (
        isinstance(tokenizer, FastBase)
        and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode
        and getattr(cls, "_decode", None) is FastBase._decode
    )
    if not stock or backend_decode is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return BackendDecode(backend_decode, decode)


class BackendDecode:
    """The backend's decode for plain id lists, ``tokenizer.decode`` for anything else.
    A class rather than a closure: it pickles (with its tokenizer) for the export
    process of :mod:`otel_verl.offload`, which decodes the trajectory JSONL's texts."""

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
