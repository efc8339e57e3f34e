"""Samples from a worker's Prometheus text (``/metrics``), read a line at a time.

The router reads every worker's ``/metrics`` each health interval for the costs it
routes with. prometheus_client's parser walks the text a character at a time: ~2 ms for
a worker's 300 lines, three times a probe, was most of an idle router's CPU (0.9-1.2 s a
minute behind three workers) on machines whose cores the workers need. This reader
takes a line with one regular expression and keeps the same samples under the same
names: the sample's own name (``_total``, ``_bucket``, ``_sum``... included), its
labels unescaped, its value as a float (``NaN`` and ``+Inf`` too).

A malformed line ends the reading: what parsed before it is kept, as a caller of
prometheus_client's parser would have it (it raises at the line).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# name, optional {labels} (up to the line's last '}': a label value may hold one), value,
# optional timestamp.
_SAMPLE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s+(\S+)(?:\s+-?[0-9]+)?\s*"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE = re.compile(r'\\[\\"n]')


class MetricsTextError(ValueError):
    """A line that is not a sample, a comment or blank."""


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line, in order; raises ``MetricsTextError``
    at the first malformed one."""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _SAMPLE.fullmatch(stripped)
        if match is None:
            raise MetricsTextError(f"not a sample: {stripped[:120]!r}")
        name, label_text, value_text = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            raise MetricsTextError(f"not a value: {stripped[:120]!r}") from None
        yield name, _labels(label_text or "", stripped), value


def _labels(text: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise MetricsTextError(f"bad labels: {line[:120]!r}")
        key, raw = match.groups()
        labels[key] = _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], raw)
        pos = match.end()
    return labels
