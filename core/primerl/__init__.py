"""primerl: asynchronous RL post-training for large MoE models, built from plugins.

The core is deliberately small and light to import: hook specs, the plugin registry,
typed config and the CLI. Everything that does real work (models, environments,
inference backends, launchers...) is a plugin found through the ``primerl`` entry-point
group, and heavy libraries are imported only when a component is selected.
"""

from primerl._markers import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["hookimpl", "hookspec", "__version__"]
