"""Built-in strategies. Importing this package registers them."""

from . import chunkers, gsc, mergers  # noqa: F401
from . import csm  # noqa: F401
from . import guards  # noqa: F401
from . import scorers, eviction, cam, d2o  # noqa: F401  (baselines)
from . import fitted  # noqa: F401  (issue 14)
from . import importance, similar  # noqa: F401  (question-free importance)
