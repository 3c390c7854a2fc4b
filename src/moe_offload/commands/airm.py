"""`moe-offload airm`: run the ai-rm workload runner from the command line."""

import json

import click


@click.command("airm")
@click.option("--kind", type=click.Choice(["serve", "decode"]), required=True, help="Workload kind.")
@click.option("--model", default="", help="Model (checkpoint directory); default: the demo model or mock.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON.")
@click.argument("config", nargs=-1, metavar="[KEY=VALUE]...")
def airm(kind: str, model: str, as_json: bool, config: tuple[str, ...]) -> None:
    """Run the ai-rm workload `npu-offload` (decode prints one --metric line per measurement)."""
    from moe_offload.airm.runner import run
    from rm_core import ContractError, Workload

    options = {}
    for item in config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ContractError("config", "KEY=VALUE", item)
        options[key] = value
    result = run(Workload(kind, model), **options)
    if kind != "decode":
        return
    if as_json:
        click.echo(json.dumps([m.to_dict() for m in result], indent=2))
        return
    for m in result:
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()))
        click.echo(f"--metric {m.name}={m.value:.6g} # unit={m.unit} {labels}")


commands = [airm]
