"""Shared fixtures. Area-specific fixtures live in each tests/<area>/conftest.py."""
