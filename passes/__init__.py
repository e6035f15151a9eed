"""FX passes, in the order they run (installed as ``sage_compile.passes``).

Stage 1 runs on the Dynamo graph (torch IR) inside the backend, before AOTAutograd. Stage 2 passes run
inside Inductor, handed over through ``compile_fx(config_patches=...)`` as CustomGraphPasses.
"""
from .rewrite_sdpa import rewrite_sdpa

STAGE1 = (rewrite_sdpa,)


def run_stage1(gm, config, report):
    for pass_ in STAGE1:
        gm = pass_(gm, config, report)
    return gm


def stage2_patches(config):
    return {}
