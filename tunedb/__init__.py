"""tunedb: autotuning database and cost-model trainer for GPU kernel fusion and scheduling.

``import tunedb`` needs neither CuPy nor a GPU; only ``tunedb.runtime`` touches CuPy.
"""

__version__ = "0.1.0"
