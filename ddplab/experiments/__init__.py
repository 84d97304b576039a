"""Experiments: small models and workloads, and compare(): strategies side by side."""
from .models import SmallConvNet, batch, build, mlp, n_parameters

__all__ = ["SmallConvNet", "batch", "build", "mlp", "n_parameters"]
from .compare import CompareResult, compare
from .report import print_table
from .spec import RunSpec

__all__ += ["compare", "CompareResult", "RunSpec", "print_table"]
