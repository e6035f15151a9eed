"""FX passes, in the order they run (installed as ``sage_compile.passes``).

Stage 1 runs on the Dynamo graph (torch IR) inside the backend, before AOTAutograd. Stage 2 passes run
inside Inductor, handed over through ``compile_fx(config_patches=...)`` as CustomGraphPasses.
"""
from .absorb_rope import absorb_rope
from .graph_pass import SagePass
from .match_manual_attention import match_manual_attention
from .rewrite_sdpa import rewrite_sdpa
from .rewrite_sdpa_variants import rewrite_sdpa_variants

STAGE1 = (rewrite_sdpa, match_manual_attention, absorb_rope)


def run_stage1(gm, config, report):
    for pass_ in STAGE1:
        gm = pass_(gm, config, report)
    return gm


def stage2_patches(config, report):
    """Inductor config patches that install our stage-2 passes (one callable per hook: torch 2.11)."""
    return {"joint_custom_post_pass": SagePass(rewrite_sdpa_variants, config, report)}
