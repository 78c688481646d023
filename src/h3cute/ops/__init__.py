"""`torch.ops.h3`: importing this package registers every H3 op (schemas in docs/ARCHITECTURE.md)."""
from h3cute.ops import adaln, linear, model, timestep  # noqa: F401  (registration)
from h3cute.ops._library import install_native

install_native()
