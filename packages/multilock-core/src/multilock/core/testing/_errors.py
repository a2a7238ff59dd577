"""`error_texts`: everything an exception and its chain would show, to look for secrets."""

from __future__ import annotations

__all__ = ["error_texts"]


def error_texts(exc: BaseException) -> list[str]:
    """str, repr and args of *exc* and of every exception chained to it, either way.

    For tests that a secret appears nowhere a traceback, a log or a debugger could show:
    ``assert all(password not in t for t in error_texts(caught.value))``.
    """
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo += [current.__cause__, current.__context__]
    return [t for e in found for t in (str(e), repr(e), *(repr(a) for a in e.args))]
