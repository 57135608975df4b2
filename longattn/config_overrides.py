"""The one grammar of config overrides on the command line: `key=value` pairs separated by commas.

    attention_type=sliding,sliding_window=64,hidden_dropout_prob=0.0
    num_hidden_layers=4,attention_type=[sliding,sliding,sliding,full]

transformers' `--config_overrides` format, plus lists in brackets. The recipes (`--config_overrides`),
`longattn-visualize` (`--config_overrides`) and `scripts/benchmark.py` (`--set`) all read it with this module, which
imports nothing of longattn, so every layer may use it.
"""

from __future__ import annotations

from typing import Any


def parse_config_overrides(overrides: str | None, *, flag: str = "--config_overrides") -> dict[str, Any]:
    """`"a=1,b=x,c=[sliding,full]"` -> `{"a": 1, "b": "x", "c": ["sliding", "full"]}`.

    Values become int, float, bool (`true`/`false`), None (`none`/`null`) or str; `[v1,v2]` becomes a list of them.
    A key given twice keeps its last value. A dotted key (`longattn.sliding_window`) names a field of a nested
    dict: a lengthened stock checkpoint keeps its longattn fields in the `longattn` dict of its config.

    Args:
        overrides: The text of the flag; None or "" gives `{}`.
        flag: The flag's name, for the error message.

    Raises:
        ValueError: an item is not `key=value` (JSON, e.g. `{"sliding_window": 4}`, is refused with the same message).
    """
    if not overrides or not overrides.strip():
        return {}
    items, depth, current = [], 0, ""
    for char in overrides:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise ValueError(
                f"{flag}: {item.strip()!r} is not of the form key=value; expected comma-separated "
                f"key=value pairs, lists in brackets, e.g. 'sliding_window=4,sliding_dilation=[1,3]'."
            )
        if value.startswith("[") and value.endswith("]"):
            inner = value[1:-1].strip()
            parsed[key] = [_scalar(v.strip()) for v in inner.split(",")] if inner else []
        else:
            parsed[key] = _scalar(value)
    return parsed


def format_config_overrides(overrides: dict[str, Any]) -> str:
    """The inverse of `parse_config_overrides` for its value types: `{"a": 1, "c": [1, 3]}` -> `"a=1,c=[1,3]"`."""

    def text(value: Any) -> str:
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(text(v) for v in value) + "]"
        return str(value).lower() if value is None or isinstance(value, bool) else str(value)

    return ",".join(f"{key}={text(value)}" for key, value in overrides.items())


def _scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip("'\"")
