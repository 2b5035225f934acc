"""User-facing errors: each says what is wrong and how to fix it.

The CLI prints these without a traceback and exits with code 2, the convention for
usage and configuration errors.
"""

__all__ = ["ConfigError", "PluginError", "PrimerlError"]


class PrimerlError(Exception):
    """Base class for errors caused by the user's input (config, plugins, requests)."""


class PluginError(PrimerlError):
    """A plugin could not be found, loaded or chosen unambiguously."""


class ConfigError(PrimerlError):
    """A configuration value is unknown, of the wrong type, or impossible."""
