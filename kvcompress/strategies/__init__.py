"""Built-in strategies. Importing this package registers them."""

from . import chunkers, gsc, mergers  # noqa: F401
