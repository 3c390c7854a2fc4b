"""Built-in backend plugins. Each registers exactly as a third-party plugin would."""
