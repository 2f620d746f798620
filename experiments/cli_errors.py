"""The errors a user of run.py sees: `UserError` (bad input: one line `error: <option>: <message>`, exit 2), how a
check's exception becomes one (`user_input`, `option_of`, `INPUT_ERRORS`) and what Hydra raises before a job starts
(`hydra_error`). Anything else is a bug: a traceback, exit 1 (experiments/runner.py `cli`).
"""

from __future__ import annotations

import os
import re
import traceback
from contextlib import contextmanager

from omegaconf import OmegaConf

from analysis import store


class UserError(ValueError):
    """Bad input (a config value, a file, a folder, a name): run.py prints `error: <line>` and exits 2, without a
    traceback unless debug=true or HYDRA_FULL_ERROR=1. Anything else is a bug: traceback, exit 1."""

    def __init__(self, option: str, message: str):
        self.option, self.message = option, " ".join(message.split())
        super().__init__(self.message)

    @property
    def line(self) -> str:
        """`<option>: <message>`, a message that starts with "<option> must ..." cut to "must ..."."""
        word = self.option.rsplit(".", 1)[-1]
        for head in (self.option, word):
            rest = self.message[len(head):] if self.message.startswith(head) else ""
            if rest.startswith((" must ", " may ")):
                return f"{self.option}: {rest.lstrip()}"
        return f"{self.option}: {self.message}"


# what a check of the user's input raises (a ValueError names a bad value, an OSError a path that is not there or
# not usable); a TypeError counts only from instantiating a config group (an unknown or mistyped argument)
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, store.StoreError)


def option_of(message: str, group: str | None, cfg) -> tuple[str, str]:
    """(option, message) for a check's message: the option is the message's first word when it names a key of
    the config (bare, or inside `group`), else `group`."""
    word = re.match(r"[A-Za-z_][\w.]*", message)
    word = word.group(0).rstrip(".") if word else ""
    option = group or "config"
    if word and group and word.startswith(f"{group}."):
        option = word
    elif word and OmegaConf.select(cfg, f"{group}.{word}" if group else word, default="<absent>") != "<absent>":
        option = f"{group}.{word}" if group else word
    return option, message


@contextmanager
def user_input(group: str | None, cfg):
    """Turns what checking `group` of the config (None = its top level) raises on bad input into a UserError."""
    from hydra.errors import InstantiationException

    try:
        yield
    except UserError:
        raise
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (*INPUT_ERRORS, TypeError)):
            raise
        raise UserError(*option_of(str(cause), group, cfg)) from err
    except INPUT_ERRORS as err:
        raise UserError(*option_of(str(err), group, cfg)) from err


def hydra_error(err: BaseException) -> UserError | None:
    """The user error behind an exception Hydra raises before a job starts (an override it cannot parse, a
    config group option or key that does not exist, an output folder it cannot create); None for anything else."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    text = str(err)
    if isinstance(err, OverrideParseException):
        detail = " ".join(err.message.split("See https://")[0].split())
        return UserError(err.override.split("=", 1)[0].lstrip("+~") or "override",
                         f"cannot parse {err.override!r} ({detail}); write KEY=VALUE, lists as [a,b], sweeps as a,b "
                         "(https://hydra.cc/docs/advanced/override_grammar/basic)")
    if isinstance(err, ConfigCompositionException):
        missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
        options = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", text)
        if missing:
            group, name = missing.groups()
            allowed = ", ".join(options.group(1).split()) if options else "none"
            return UserError(group, f"no {group} named {name!r}; choose one of: {allowed}")
        key = re.search(r"Could not (?:override|append to|delete from config\.?) '?([\w./]+)'?", text)
        if key:
            return UserError(key.group(1), f"{' '.join(text.split('full_key')[0].split())}; `python run.py --cfg job` "
                             "lists the options")
        return UserError("config", " ".join(text.split("Config search path")[0].split()))
    frames = traceback.extract_tb(err.__traceback__)
    if not frames or any(f.name == "run_point" for f in frames):
        return None  # raised inside a job: the runner has classified it
    if isinstance(err, OSError) and any(f"{os.sep}hydra{os.sep}" in f.filename for f in frames):
        return UserError("results_dir", f"cannot create Hydra's output folder {err.filename} ({err.strerror}); choose "
                         "a results_dir=... (or hydra.run.dir / hydra.sweep.dir) you can write")
    if isinstance(err, ValueError) and any(part in frames[-1].filename for part in (f"{os.sep}hydra{os.sep}",
                                                                                  f"{os.sep}omegaconf{os.sep}")):
        return UserError("override", f"{' '.join(text.split())} (composing the config from the command line)")
    return None
