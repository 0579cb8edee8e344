"""Window plans for perplexity protocols: which tokens each window feeds and which it scores.

Every window holds exactly ``length`` tokens ``ids[begin:begin + length]``; it scores the targets
``first_target .. begin + length - 1`` (target ``t`` is predicted from the logits at ``t - 1``).
Across a document's windows each target is scored at most once: with ``chunks`` every one from position 1
on, with ``sliding`` every one from position ``length - stride`` on. The last window is aligned to the
document's end, so it is full length too and scores only what is left.

- ``sliding`` (the YaRN paper's evaluation, after Press et al.): windows move by ``stride`` and score
  only tokens the previous window did not; the first window scores only positions >= length - stride,
  so every scored token sees at least ``length - stride`` tokens of context.
- ``chunks``: consecutive windows sharing one boundary token, so every token after the first is
  scored exactly once (positions 1 .. length - 1 of each window). Cheaper; contexts are 0 .. length - 1.
"""

from __future__ import annotations

from typing import NamedTuple

PROTOCOLS = ("sliding", "chunks")


class Window(NamedTuple):
    begin: int
    first_target: int
    length: int

    @property
    def end(self) -> int:
        return self.begin + self.length

    @property
    def n_targets(self) -> int:
        return self.end - self.first_target


def default_stride(length: int) -> int:
    """Half the window: every scored token has at least length/2 tokens of context."""
    return max(1, length // 2)


def check_protocol(protocol: str, length: int, stride: int | None) -> int | None:
    """Validate a protocol request; returns the stride to use (None for chunks)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an integer >= 2, got {length!r}")
    if protocol == "chunks":
        return None
    stride = default_stride(length) if stride is None else int(stride)
    if not 1 <= stride <= length - 1:
        raise ValueError(f"stride must be between 1 and length - 1 = {length - 1} for length {length}, got {stride}")
    return stride


def plan_windows(
    n_tokens: int, length: int, protocol: str = "sliding", stride: int | None = None, max_windows: int | None = None
) -> list[Window]:
    """The windows scoring a document of ``n_tokens`` tokens at window ``length`` (empty if it is shorter)."""
    stride = check_protocol(protocol, length, stride)
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    if n_tokens < length:
        return []
    if protocol == "chunks":
        step, first = length - 1, 1
    else:
        step, first = stride, length - stride
    windows = [Window(0, first, length)]
    scored_to = length  # targets < scored_to are done
    while scored_to < n_tokens:
        if max_windows is not None and len(windows) >= max_windows:
            break
        begin = min(windows[-1].begin + step, n_tokens - length)
        windows.append(Window(begin, scored_to, length))
        scored_to = begin + length
    return windows[:max_windows] if max_windows is not None else windows
