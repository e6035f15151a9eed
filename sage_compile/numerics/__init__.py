"""The bottom layer: what 8-bit attention computes, in plain PyTorch — ``scheme`` (every numerics choice, typed) and
``spec`` (the definition every kernel is tested against) — and ``notices`` (warn once per reason), which every layer
above may use. Imports torch and the standard library only (docs/design.md, "Layers")."""
