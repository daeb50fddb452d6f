"""The CLI: thin Typer modules, one per subcommand (installed as ``moetool.commands``)."""
