"""Keep torch's capture chatter out of the user's console.

``torch.export`` logs warnings a user of shardplan cannot act on (``dimension
inputs['input_ids'].shape[0] 0/1 specialized; Dim.AUTO was specified ...``,
six per capture of a Hugging Face model): shardplan captures each way of
calling anew, so they change nothing. While exporting, torch's export and
shape loggers hand their records to the ``shardplan.capture`` logger at debug
level instead (``logging.getLogger("shardplan.capture").setLevel("DEBUG")``
shows them). Its warning that a forward assigned a tensor attribute is
dropped: capture puts the attribute back (``planner.model_state``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

LOG = logging.getLogger("shardplan.capture")
# the loggers (and their children) whose records a capture keeps at debug level
_CHATTY = ("torch._export", "torch.export", "torch.fx.experimental", "torch._dynamo",
           "torch._subclasses", "torch._functorch")


class _ToDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if LOG.isEnabledFor(logging.DEBUG):
            LOG.debug("%s: %s", record.name, record.getMessage())
        return False


@contextlib.contextmanager
def quiet_export():
    """Inside this block torch's export loggers write to ``shardplan.capture`` at debug level."""
    loggers = [logging.getLogger(name)
               for name, obj in list(logging.root.manager.loggerDict.items())
               if isinstance(obj, logging.Logger) and name.startswith(_CHATTY)]
    loggers += [logging.getLogger(name) for name in _CHATTY]
    to_debug = _ToDebug()
    for logger in loggers:
        logger.addFilter(to_debug)
    try:
        with warnings.catch_warnings():
            # shardplan restores what the forward assigns (planner.model_state)
            warnings.filterwarnings("ignore", message=r"The tensor attribute .* was assigned "
                                    r"during export", category=UserWarning)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(to_debug)


# torch's own pytree deprecation, raised inside torch whenever a GraphModule is deep-copied
# (as rewriting does), which no caller of shardplan can act on
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                        category=FutureWarning)
