"""The torch.library ops, in the ``sage`` namespace. Importing this package registers every one of them (never
``import sage_compile``, which registers nothing: the backend, ``sage_attention`` and the tests import it).

* ``quantized`` — the library, ``sage::quantized_attention`` (opaque; its kernel chosen per device by
  ``kernels.dispatch``) and ``quantized_forward``, the 8-bit forward around it.
* ``attention`` — ``sage::attention``, ``sage::attention_with_lse``, ``sage::rope_attention`` (CompositeImplicitAutograd
  decompositions choosing between the 8-bit attention and SDPA) and ``sage::planned_attention`` (a per-step plan).
* ``autograd`` — ``AttentionFunction``, sage.attention's backward, and the 8-bit backward's ops.
* ``varlen`` — packed ragged batches: ``sage::attention_varlen``, ``sage::quantized_attention_varlen``,
  ``sage::document_attention``.
* ``context_parallel`` — ring and Ulysses attention over a process group, and ``sage::context_parallel_attention``.
"""
from . import attention, autograd, context_parallel, quantized, varlen  # noqa: F401  (each registers its ops)
