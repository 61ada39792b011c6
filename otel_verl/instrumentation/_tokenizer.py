"""The decode and encode functions the trajectory JSONL gets for a rollout worker's tokenizer.

The JSONL is written in the export process (:mod:`otel_verl.offload`), which receives
these functions pickled. Pickling ``tokenizer.decode`` would send the whole Hugging Face
tokenizer, and the export process would import ``transformers`` and ``torch`` to load
it (about 0.5 GB and seconds of CPU per worker). For a stock fast tokenizer the work is
done by its Rust backend (a ``tokenizers.Tokenizer``), so these functions send the
backend alone. Any other tokenizer's own methods are used, and sent, as they are.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

DECODER_ATTR = "_otel_verl_text_decoder"
ENCODER_ATTR = "_otel_verl_text_encoder"


def text_decoder(tokenizer: Any) -> Optional[Callable[..., str]]:
    """``decode(ids, skip_special_tokens=False) -> str``, equal to ``tokenizer.decode``
    (``None`` without a tokenizer)."""
    decoder = getattr(tokenizer, DECODER_ATTR, None)
    if decoder is None and hasattr(tokenizer, "decode"):
        backend = _stock_backend(tokenizer, "decode", "_decode")
        # the backend does not clean up spaces: only where the tokenizer would not either
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            decoder = BackendDecode(backend, tokenizer.decode)
        else:
            decoder = tokenizer.decode
        _remember(tokenizer, DECODER_ATTR, decoder)
    return decoder


def text_encoder(tokenizer: Any) -> Optional[Callable[..., Any]]:
    """``encode(text, add_special_tokens=False) -> ids``: ``tokenizer.encode``, sent to
    the export process as the backend alone (see the module docs)."""
    encoder = getattr(tokenizer, ENCODER_ATTR, None)
    if encoder is None and hasattr(tokenizer, "encode"):
        backend = _stock_backend(tokenizer, "encode", "_encode_plus")
        if backend is not None:
            encoder = BackendEncode(backend, bool(getattr(tokenizer, "split_special_tokens", False)), tokenizer.encode)
        else:
            encoder = tokenizer.encode
        _remember(tokenizer, ENCODER_ATTR, encoder)
    return encoder


def _remember(tokenizer: Any, attr: str, function: Any) -> None:
    # One object per tokenizer, so the export process is sent each tokenizer's functions once.
    try:
        setattr(tokenizer, attr, function)
    except Exception:  # a tokenizer that takes no attributes: chosen again next time
        pass


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
