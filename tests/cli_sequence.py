"""Run several ``moetool`` commands one after another in ONE process: ``python cli_sequence.py runs.json`` (a JSON
list of argument lists). Under ``torchrun`` every rank runs the same sequence, so one launch (one process group,
one import of torch) serves many commands; the first command that fails ends the sequence with its exit code. The
click command is built from the Typer app once (``app(args)`` builds it afresh on every call: 19 ms of CPU a command)."""

from __future__ import annotations

import json
import sys

from typer.main import get_command

from moetool.commands.app import app


def main() -> None:
    command = get_command(app)
    for args in json.loads(open(sys.argv[1]).read()):
        code = command.main(args, prog_name="moetool", standalone_mode=False)
        if code not in (None, 0):
            sys.stderr.write(f"cli_sequence: exit {code}: moetool {' '.join(args)}\n")
            sys.exit(code)


if __name__ == "__main__":
    main()
