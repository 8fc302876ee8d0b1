"""The core: the state pytree, the step's stage pipeline and the closed transform protocol.

Everything else in functrain is built on these modules, and none of them imports
anything above (see docs/architecture.md): :mod:`.tree` (pytree helpers),
:mod:`.state` (:class:`TrainState`), :mod:`.registry` (checkpoint type allow-list),
:mod:`.step` (the stages, :class:`Step`, :class:`Transform`), :mod:`.grad` (the loss
contract and the eager gradient), :mod:`.eager` (host shortcuts), :mod:`.rng`,
:mod:`.checks`, :mod:`.flat` / :mod:`.layout` (the flat layout), :mod:`.module`
(functionalize), :mod:`.optimizer` (the optimizer protocol check), :mod:`.validate`.
"""
