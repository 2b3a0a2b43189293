"""The shipped cost models, one ``<device>/<kind>/`` directory each (see README.md); installed as
the package data of ``tunedb.models`` and found by ``tunedb.costmodel.registry``."""
