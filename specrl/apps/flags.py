"""Command-line flags made from `Settings` fields: one definition of each knob, its type, help and
allowed values; every flag also reads `SPECRL_<NAME>` from the environment (`Settings.load`)."""

from __future__ import annotations

import argparse

from specrl.config import Settings

TYPES = {"int": int, "float": float, "str": str, "Path": str}
COMMON = ("home", "threads")
ENGINE = ("model", "drafter", "draft_vocab_size", "max_draft_tokens", "max_batch", "suffix_capacity", "suffix_max_tokens",
          "dtype")


def add_settings(parser: argparse.ArgumentParser, *names: str, aliases: dict[str, list[str]] | None = None) -> None:
    """`--max-batch` etc. for the named settings (plus `aliases`: extra option strings per name);
    `settings_from(args)` collects them."""
    for name in names:
        kind, help_text, choices = Settings.help_of(name)
        options = [f"--{name.replace('_', '-')}", *(aliases or {}).get(name, [])]
        help_text = f"{help_text} (env SPECRL_{name.upper()})"
        if kind == "bool":
            parser.add_argument(*options, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(*options, dest=name, type=TYPES[kind], default=None, choices=choices,
                                help=help_text)
    parser.set_defaults(settings_names=tuple(parser.get_default("settings_names") or ()) + names)


def settings_from(args: argparse.Namespace, **extra) -> Settings:
    """Settings from the flags a command declared (None: not given), then `extra`; sets torch's threads."""
    flags = {name: getattr(args, name) for name in getattr(args, "settings_names", ())}
    settings = Settings.load(**flags, **extra)
    if settings.threads > 0:
        import torch

        torch.set_num_threads(settings.threads)
    return settings
