"""Every extension point of moe-offload, as pluggy hookspecs.

A plugin is a module (or object) with functions named like these and marked
with ``hookimpl``. Built-in backends are plugins too (``backends.DEFAULT_PLUGINS``);
third parties register under the entry-point group ``moe_offload.backends``.
"""

import pluggy

hookspec = pluggy.HookspecMarker("moe_offload")
hookimpl = pluggy.HookimplMarker("moe_offload")


@hookspec
def moe_offload_register_backends(register):
    """Called once when the plugin manager first lists backends.

    Call ``register(backend)`` with each ``moe_offload.backends.Backend`` the
    plugin provides. Must not open devices or import heavy modules (torch):
    detection happens later, in ``Backend.availability()``.
    """


@hookspec
def moe_offload_register_commands(cli):
    """Called when the CLI starts, with the root ``click.Group``.

    Add commands with ``cli.add_command(...)``. Keep imports inside the
    command functions so that ``moe-offload --help`` stays fast.
    """
