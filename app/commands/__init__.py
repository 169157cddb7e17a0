"""One module per `mpipemoe` subcommand (app/cli.py dispatches): each parses its arguments and
calls into a wing (jobs, bench, reports, tracking); no wing imports a command."""
