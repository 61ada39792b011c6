"""The verl versions otel_verl's wrappers are written against (data, as in
opentelemetry-python-contrib's ``package.py``)."""

_instruments = ("verl >= 0.9, < 0.10",)
