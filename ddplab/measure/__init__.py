"""Measuring: RunSpec, compare() (strategies side by side on live ranks), sweeps, the models they time."""
from ddplab.measure.models import SmallConvNet, batch, build, mlp, n_parameters

__all__ = ["SmallConvNet", "batch", "build", "mlp", "n_parameters"]
from ddplab.measure.compare import CompareResult, compare
from ddplab.measure.report import print_table
from ddplab.measure.spec import RunSpec

__all__ += ["compare", "CompareResult", "RunSpec", "print_table"]
