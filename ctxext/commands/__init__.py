"""CLI subcommands, one module each (see ``ctxext.cli.COMMAND_MODULES``)."""
