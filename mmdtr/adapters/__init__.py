"""MMEngine adapters: thin hooks, wrappers and runner glue over mmdtr's core.

Each adapter module registers itself on import; add one line per module.
"""
from . import activation_checkpointing_hook  # noqa: F401
from . import checkpoint_loading  # noqa: F401
from . import config_translation  # noqa: F401
from . import conv_bn_eval_hook  # noqa: F401
from . import distributed  # noqa: F401
from . import dtr_hook  # noqa: F401
from . import dtr_model_wrapper  # noqa: F401
from . import inplace_optim_wrapper  # noqa: F401
from . import model_data_checks  # noqa: F401
from . import runner  # noqa: F401
