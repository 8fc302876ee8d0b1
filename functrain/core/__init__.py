"""The core: the state pytree, the step's stage pipeline and the closed transform protocol.

Everything else in functrain is built on these modules, and none of them imports
anything above (see docs/architecture.md): :mod:`.tree` (pytree helpers),
:mod:`.state` (:class:`TrainState`), :mod:`.registry` (checkpoint type allow-list),
:mod:`.transform` (the closed protocol: :class:`Transform`, its contexts, the stage/hook
table), :mod:`.step` (the stage pipeline and :class:`Step`), :mod:`.grad` (the loss
contract and the micro-batch gradient), :mod:`.eager` (the one-path interface: the eager
step's host shortcuts, the one ``is_compiling`` test), :mod:`.rng`, :mod:`.checks`,
:mod:`.flat` (the one flat layout: the flat state and the shards), :mod:`.module`
(functionalize), :mod:`.optimizer` (the optimizer protocol check), :mod:`.validate`.
"""
