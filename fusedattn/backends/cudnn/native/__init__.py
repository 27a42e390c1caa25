"""The native launch path of the cuDNN backend: one C++ launch core (launch_core.cc, loaded by
core.py) under a torch operator with C++ autograd (torch_op.cc, torch_plans.py) and an XLA FFI
handler (jax_call.cc, driven by fusedattn.jax.native), compiled once per machine from source
(build.py)."""
