"""The policy layer: what a user chose (``config``: SageConfig; ``plan``: a per-site precision plan, as data), which
calls sage can run and which it runs faster than SDPA (``support``, with the verdict on a site), and the report of the
sites a compile found (``sites``). Imports the kernels and the numerics below it (docs/design.md, "Layers")."""
