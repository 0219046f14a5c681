"""fabric-mlflow: an MLflow logger for fabric-core (``Fabric(loggers="mlflow")``).

Importing this package is cheap (the registration module is imported while plugins are discovered);
:class:`MLFlowLogger` and ``mlflow`` are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_mlflow.logger import MLFlowLogger

__all__ = ["MLFlowLogger"]

__getattr__, __dir__ = lazy_exports(__name__, "fabric-mlflow", {"MLFlowLogger": "fabric_mlflow.logger"})
