"""`moe-offload`: the command line. Errors are one line on stderr with a non-zero exit (`--debug` shows the traceback)."""

from __future__ import annotations

import sys
import traceback
from importlib import import_module

import click

from moe_offload import __version__
from moe_offload.commands.options import emit
from moe_offload.errors import OffloadError
from rm_core import PROTOCOL_VERSION, ContractError

# Long-running services keep their structured info logs; every other command is for people (log.configure in cli).
SERVICES = ("worker", "gateway", "serve", "airm")
# Each module defines `commands`: a list of click commands. Imports inside them stay lazy (fast --help).
COMMAND_MODULES = (
    "moe_offload.commands.plan",
    "moe_offload.commands.engine",
    "moe_offload.commands.serve",
    "moe_offload.commands.airm",
    "moe_offload.commands.protocol",
    "moe_offload.commands.costmodel",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120, "terminal_width": 120})
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("--verbose", "-v", is_flag=True, help="Show the engine's info log lines (commands for people show warnings only).")
@click.version_option(__version__, "--version", prog_name="moe-offload")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """Run Mixture-of-Experts LLMs larger than accelerator memory."""
    from moe_offload import log, settings

    if debug:
        log.configure(level="debug")
    elif ctx.invoked_subcommand in SERVICES or verbose:
        log.configure()  # structured lines (JSON off a terminal) at $MOE_OFFLOAD_LOG's level
    else:  # a command for people: its output is the answer; warnings only, as text, unless the user set otherwise
        log.configure(level=None if settings.is_set("MOE_OFFLOAD_LOG") else "warning",
                      json=None if settings.is_set("MOE_OFFLOAD_LOG_JSON") else False)
    ctx.obj = {"debug": debug}


@cli.command()
def version() -> None:
    """Print the package and rm-core protocol versions."""
    click.echo(f"moe-offload {__version__} (rm-core protocol {PROTOCOL_VERSION})")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def backends(as_json: bool) -> None:
    """List backends: available here or why not, and their memory tiers."""
    from moe_offload import backends as be

    rows = []
    for b in be.backends().values():
        a = b.availability()
        tiers = [t.to_dict() for t in b.tiers()] if a.ok else []
        rows.append({"name": b.name, "description": b.description, "available": a.ok, "reason": a.reason, "tiers": tiers})
    lines = []
    for r in rows:
        status = "available" if r["available"] else f"not available: {r['reason']}"
        lines.append(f"{r['name']:6} {status}")
        for t in r["tiers"]:
            acc = f" on {t['accelerator']}" if t["accelerator"] else ""
            lines.append(f"       tier {t['name']:8} {t['kind']:10} {t['capacity_bytes'] / 2**30:8.1f} GiB{acc}")
    emit(rows, as_json, "\n".join(lines))


@cli.command()
def selftest() -> None:
    """Run the hardware-free checks: one pass/fail line per area."""
    from moe_offload.selftest import run_all

    failed = run_all(click.echo)
    if failed:
        raise SystemExit(1)


def _load_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            mod = import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # an area not built yet
                continue
            raise
        for command in mod.commands:
            cli.add_command(command)
    from moe_offload.backends import plugin_manager

    plugin_manager().hook.moe_offload_register_commands(cli=cli)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        _load_commands()
        result = cli.main(args=args, prog_name="moe-offload", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.Abort:
        click.echo("error: aborted", err=True)
        return 1
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except (OffloadError, ContractError) as e:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {e}", err=True)
        return 1
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's last line of defence: one line, not a traceback
        if debug:
            traceback.print_exc()
        click.echo(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
