"""A rollout worker's tokenizer as outputs decode its token ids with, off the event loop.

Those outputs (the trajectory JSONL) run in the export process (:mod:`otel_verl.offload`),
which receives the worker's :class:`TextCodec` pickled, once per tokenizer. For a stock
fast tokenizer the work is done by its Rust backend (a ``tokenizers.Tokenizer``), so the
codec sends the backend alone; any other tokenizer's own methods are used, and sent, as
they are. Pickling ``tokenizer.decode`` would send the whole Hugging Face tokenizer, and
the export process would import ``transformers`` and ``torch`` to load it; so would
loading it again from the model's path. Measured in a fresh process with the demo's
tokenizer: ``AutoTokenizer.from_pretrained(path)`` 4.2 s of CPU and +772 MB RSS (torch
comes with it), the pickled backend 0.02 s and +9 MB. The backend alone from the path's
``tokenizer.json`` costs as little, but only where the path is local to the export process
and the tokenizer is a stock one the worker did not change.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

CODEC_ATTR = "_otel_verl_text_codec"


class TextCodec(NamedTuple):
    """``decode(ids, skip_special_tokens=False) -> str`` and ``encode(text,
    add_special_tokens=False) -> ids`` of one tokenizer (either may be ``None``)."""

    decode: Optional[Callable[..., str]]
    encode: Optional[Callable[..., Any]]


def text_codec(tokenizer: Any) -> Optional[TextCodec]:
    """The codec of ``tokenizer`` (``None`` without one): its ``decode`` and ``encode``,
    sent to the export process as the backend alone where they are transformers' own.
    One object per tokenizer, so that the export process is sent each tokenizer once."""
    if tokenizer is None:
        return None
    codec = getattr(tokenizer, CODEC_ATTR, None)
    if codec is None:
        codec = TextCodec(_decoder(tokenizer), _encoder(tokenizer))
        try:
            setattr(tokenizer, CODEC_ATTR, codec)
        except Exception:  # a tokenizer that takes no attributes: made again next time
            pass
    return codec


def _decoder(tokenizer: Any) -> Optional[Callable[..., str]]:
    if not hasattr(tokenizer, "decode"):
        return None
    backend = _stock_backend(tokenizer, "decode", "_decode")
    # the backend does not clean up spaces: only where the tokenizer would not either
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return BackendDecode(backend, tokenizer.decode)
    return tokenizer.decode


def _encoder(tokenizer: Any) -> Optional[Callable[..., Any]]:
    if not hasattr(tokenizer, "encode"):
        return None
    backend = _stock_backend(tokenizer, "encode", "_encode_plus")
    if backend is not None:
        return BackendEncode(backend, bool(getattr(tokenizer, "split_special_tokens", False)), tokenizer.encode)
    return tokenizer.encode


def _stock_backend(tokenizer: Any, method: str, fast_method: str) -> Any:
    """The Rust backend of a fast tokenizer whose ``method`` is transformers' own (it then
    only calls the backend), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        try:  # transformers >= 5
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as FastBase
        except ImportError:
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as FastBase
    except ImportError:
        return None
    cls = type(tokenizer)
    stock = (
        isinstance(tokenizer, FastBase)
        and getattr(cls, method, None) is getattr(PreTrainedTokenizerBase, method, False)
        and getattr(cls, fast_method, None) is getattr(FastBase, fast_method, False)
    )
    return getattr(tokenizer, "_tokenizer", None) if stock else None


class BackendDecode:
    """A stock fast tokenizer's ``decode``, done by its backend; pickles as the backend alone."""

    def __init__(self, backend: Any, decode: Optional[Callable[..., str]] = None) -> None:
        self.backend = backend
        self.decode = decode  # tokenizer.decode, for ids the backend does not take; not sent

    def __call__(self, ids: Any, skip_special_tokens: bool = False) -> str:
        try:
            ids = ids if type(ids) is list else [int(i) for i in ids]
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except (TypeError, ValueError, OverflowError):
            if self.decode is None:
                raise
            return self.decode(ids, skip_special_tokens=skip_special_tokens)

    def __reduce__(self) -> tuple:
        return BackendDecode, (self.backend,)


class BackendEncode:
    """A stock fast tokenizer's ``encode`` of one text. In the worker: ``tokenizer.encode``
    itself. Pickled: its backend alone, set up as that ``encode`` sets it up (no
    truncation, no padding, special tokens split as the tokenizer says)."""

    def __init__(self, backend: Any, split_special_tokens: bool, encode: Optional[Callable[..., Any]] = None) -> None:
        self.backend = backend
        self.split_special_tokens = split_special_tokens
        self.encode = encode
        if encode is None:  # the export process's own copy: ours to set up
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = split_special_tokens

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> List[int]:
        if self.encode is not None:
            return self.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __reduce__(self) -> tuple:
        return BackendEncode, (self.backend, self.split_special_tokens)
