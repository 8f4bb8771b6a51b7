"""The command line of every script: argparse whose usage errors are one line.

Only the standard library, so that the data scripts (datasets/), which run without torch, can use it too.
"""

from __future__ import annotations

import argparse
import os
import typing


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line on stderr (not argparse's usage block) and exit code 2. Under torchrun every
    rank parses the same command line: rank 0 alone says what is wrong."""

    def explain(self, message: str) -> str:
        """The error's words; a parser with more to say (the training scripts' valid keys) adds to them."""
        return f"{message} (see --help)"

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\n" if os.environ.get("RANK", "0") == "0" else None)
