"""The native launch path of the cuDNN backend: one C++ launch core (launch_core.h) under a torch
operator with C++ autograd (torch_op.cc, torch_plans.py) and the JAX FFI handler (fusedattn/jax/native),
compiled once per machine from source (build.py)."""
