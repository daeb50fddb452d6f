"""Run several ``moetool`` commands one after another in ONE process: ``python cli_sequence.py runs.json`` (a JSON
list of argument lists). Under ``torchrun`` every rank runs the same sequence, so one launch (one process group,
one import of torch) serves many commands; the first command that fails ends the sequence with its exit code."""

from __future__ import annotations

import json
import sys

from moetool.commands.app import app


def main() -> None:
    for args in json.loads(open(sys.argv[1]).read()):
        code = app(args, prog_name="moetool", standalone_mode=False)
        if code not in (None, 0):
            sys.stderr.write(f"cli_sequence: exit {code}: moetool {' '.join(args)}\n")
            sys.exit(code)


if __name__ == "__main__":
    main()
