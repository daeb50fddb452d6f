"""``python -m moetool``: the same entry point as the ``moetool`` console script."""

from moetool.commands.app import main

if __name__ == "__main__":
    main()
