"""The rm-core protocol version: MAJOR.MINOR; see PROTOCOL.md for what a bump means."""

PROTOCOL_VERSION = "0.1"
