"""Experiments: small models and workloads, and compare(): strategies side by side."""
from .models import SmallConvNet, batch, build, mlp, n_parameters

__all__ = ["SmallConvNet", "batch", "build", "mlp", "n_parameters"]
from .cli import print_table
from .compare import CompareResult, compare

__all__ += ["compare", "CompareResult", "print_table"]
