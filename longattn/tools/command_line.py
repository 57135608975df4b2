"""What every command line the project ships shares: a parser that takes flags only as spelled, and the redaction of
secrets from what a run records.

- `CommandLineParser`: argparse without abbreviations. argparse accepts any unambiguous prefix of a flag
  (`--hub_tok` for `--hub_token`), so a redaction keyed on the typed spelling would miss it; with abbreviations off
  the typed flag is the declared one. Unrecognized arguments are reported by their flags only, since the word after
  a mistyped secret flag is the secret.
- `is_secret_flag`, `redact_argv`, `redact_command`: the value of a secret flag (`--hub_token`, `--token`,
  `--db_password`, ...) replaced by `REDACTED`.
- `secret_values(parser, args)`: the parsed values of every secret destination, whatever spelling set them, so a
  recorded command line can be redacted by value as well (`redact_values`).

Scripts under `scripts/` that must not import the package pass `allow_abbrev=False` to argparse themselves; a test
checks every parser the project ships.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterable

__all__ = [
    "REDACTED",
    "CommandLineParser",
    "is_secret_flag",
    "redact_argv",
    "redact_command",
    "redact_values",
    "secret_values",
]

REDACTED = "REDACTED"
# Flags whose value is a secret: --hub_token, --token, --use_auth_token, --db_password, --wandb_api_key, ... but
# not --tokenizer_name or --global_tokens (a plural count, not a credential).
_SECRET_FLAG = re.compile(r"password|passwd|secret|api_?key|credential|(?:^|_)token$")


class CommandLineParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with abbreviations off (its sub-commands too: they are made of this class) and
    unrecognized arguments reported by flag, never by value."""

    def __init__(self, *args, **kwargs):
        if kwargs.pop("allow_abbrev", False):
            raise ValueError("allow_abbrev=True: a prefix of a secret flag would escape its redaction.")
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [word.partition("=")[0] for word in extras if word.startswith("-")]
            hidden = len(extras) - len(flags) + sum("=" in word for word in extras if word.startswith("-"))
            shown = " ".join(flags) + (f" (and {hidden} value(s), not shown)" if hidden else "")
            self.error(f"unrecognized arguments: {shown}")
        return parsed


def is_secret_flag(flag: str) -> bool:
    """Whether a command-line flag or destination (`--hub_token`, `hub-token`, `HUB_TOKEN`) carries a secret."""
    return bool(_SECRET_FLAG.search(flag.lstrip("-").lower().replace("-", "_")))


def secret_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The non-empty string values `args` holds for the secret destinations of `parser` (and its sub-commands):
    what must appear nowhere a run records, however the flag was typed."""
    values = []
    for action in _actions(parser):
        if action.dest is argparse.SUPPRESS:
            continue
        if is_secret_flag(action.dest) or any(is_secret_flag(flag) for flag in action.option_strings):
            value = getattr(args, action.dest, None)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, str) and item:
                    values.append(item)
    return values


def _actions(parser: argparse.ArgumentParser) -> Iterable[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def redact_values(words: list[str], secrets: Iterable[str]) -> list[str]:
    """`words` with every occurrence of each secret value replaced by `REDACTED` (longest first, so a secret that
    contains another is redacted whole)."""
    secrets = sorted(set(secrets), key=len, reverse=True)
    out = []
    for word in words:
        for secret in secrets:
            word = word.replace(secret, REDACTED)
        out.append(word)
    return out


def redact_argv(argv: list[str], recorded_value=None) -> list[str]:
    """`argv` with the value of every secret flag replaced by `REDACTED`, in both `--flag value` and `--flag=value`
    forms; `recorded_value(flag, value)` may rewrite the other values (e.g. paths)."""
    out: list[str] = []
    flag = None  # the flag whose value the next word may be
    for word in argv:
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            flag = None if sep else name
            if sep:
                word = f"{name}={_recorded(name, value, recorded_value)}"
        elif flag is not None:
            word, flag = _recorded(flag, word, recorded_value), None
        out.append(word)
    return out


def _recorded(flag: str, value: str, recorded_value) -> str:
    if is_secret_flag(flag):
        return REDACTED
    return recorded_value(flag, value) if recorded_value is not None else value


def redact_command(command: str) -> str:
    """A shell command line with the values of its secret flags replaced by `REDACTED`."""
    try:
        return shlex.join(redact_argv(shlex.split(command)))
    except ValueError:  # unbalanced quotes: not a command line we can parse, so keep none of it
        return REDACTED
