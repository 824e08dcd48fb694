"""``l2l plan``: the analytic memory and time model of the L2L papers and the layered-GA paper.

- ``costmodel``: l2l-v1 §3.1 eqs. 1-7 and l2l-v2 §2.2.1 eqs. 1-6, as pure functions of the papers' symbols.
- ``scaling``: layered-GA §5 and appendices B-C (X[x], critical batch size, compute, memory breakdown,
  arithmetic intensities, 3d-parallel configurations).
- ``shapes`` / ``hardware`` / ``measure``: what the config's model costs, and the machine's rates (from
  ``conf/hardware``, or timed here with ``hardware=measure``).
- ``knobs`` / ``memory`` / ``steptime``: one config's setup, its bytes by part and its seconds by phase;
  ``estimate`` / ``views`` / ``planner``: the plan of one config built from them; ``render`` and ``cli``: the
  command.
- ``candidates`` / ``search``: layered-GA §5's search space, costed as arrays, and the search over it.
"""


class PlanError(Exception):
    """A plan that cannot be made from the input (e.g. hardware=measure cannot time a layer here)."""
