"""Where the eager param-server keeps each layer's training state: a :class:`Tier` that ``eps.tier`` selects.

- :mod:`.base`: the :class:`Tier` protocol, :class:`TierSettings`, :class:`TierKind` and the registry
- :mod:`.host`: ``host`` (the default), every layer in RAM
- :mod:`.disk`: ``disk``, one file per layer and a few layers in RAM

A new tier is one module that implements :class:`Tier` and calls :func:`register_tier` with its
:class:`TierKind` (its rules, whether it keeps files), imported below. Nothing outside its module compares
its name.
"""

# register the built-ins, in the order config messages list them ("allowed: host, disk")
# isort: off
from l2l_cli.engine.tiers import host  # noqa: F401
from l2l_cli.engine.tiers import disk  # noqa: F401

# isort: on
from l2l_cli.engine.tiers.base import TIERS, Tier, TierKind, TierSettings, make_tier, register_tier

__all__ = ["TIERS", "Tier", "TierKind", "TierSettings", "make_tier", "register_tier"]
