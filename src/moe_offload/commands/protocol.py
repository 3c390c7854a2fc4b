"""`moe-offload engine-check`: run the engine-protocol conformance checks against an engine command."""

import click


@click.command("engine-check", context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def engine_check(argv: tuple[str, ...]) -> None:
    """Check an engine process against the JSON-lines protocol (one line per check)."""
    from moe_offload.engines.conformance import run_checks

    if run_checks(list(argv), click.echo):
        raise SystemExit(1)


commands = [engine_check]
