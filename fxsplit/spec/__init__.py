"""Partition specs: a YAML file that says what a split should be, validated strictly.

A spec names the devices and their budgets, headroom to keep free, pins, groups
of modules that must share a device, how to trace and plan, and where weights the
devices cannot hold may be stored (``offload``). It is loaded
with a safe YAML loader (a spec can never run code), and *every* problem is
reported at once, each with its YAML path and line (a file too large, or with a
YAML alias, is refused at once: see :mod:`fxsplit.yamlfile`)::

    specs/mine.yaml:3: devices['cuda:1']: budget '10 GiBs' has unknown unit 'GiBs'; ...
    specs/mine.yaml:6: pinn: unknown key; did you mean 'pin'?

* :mod:`~fxsplit.spec.load`: :func:`load_spec`, reading a file, YAML text or a mapping;
* :mod:`~fxsplit.spec.fields`: validating the fields, every problem at once;
* :mod:`~fxsplit.spec.schema`: :class:`Spec`, what a validated spec holds, and :class:`SpecProblems`;
* :mod:`~fxsplit.spec.merge`: :func:`merge_spec`, a spec under the arguments of a call;
* :class:`Headroom` and :func:`reserve_bytes` (from :mod:`fxsplit.reserve`), memory kept free;
* :mod:`~fxsplit.spec.dtype`: :func:`planning_dtype`, the dtype a plan is made for.

Importing them loads no torch (device names are checked with torch when a spec is read).

>>> spec = load_spec('''
... devices:
...   cpu:0: 300KiB
...   cpu:1: {budget: 300KiB, reserve: 10%}
... pin: {"2": cpu:1}
... dtype: bf16
... ''')
>>> spec.devices, spec.pins, spec.dtype
({'cpu:0': 307200, 'cpu:1': 307200}, {'2': 'cpu:1'}, 'bfloat16')
>>> spec.reserve_for("cpu:1").of(307200)
30720
>>> load_spec("devices: {cpu:0: 1GiB}\\nobjectiv: balanced")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
fxsplit.spec.schema.SpecProblems: <spec>: 1 problem:
  <spec>:2: objectiv: unknown key; did you mean 'objective'?
"""

from fxsplit.reserve import Headroom, parse_headroom, reserve_bytes
from fxsplit.spec.dtype import DTYPES, planning_dtype
from fxsplit.spec.fields import spec_device
from fxsplit.spec.load import load_spec
from fxsplit.spec.merge import merge_spec
from fxsplit.spec.schema import DEVICE_KEYS, OFFLOAD_KEYS, SPEC_KEYS, Spec, SpecProblems
from fxsplit.yamlfile import Problem

__all__ = [
    "DEVICE_KEYS",
    "DTYPES",
    "Headroom",
    "OFFLOAD_KEYS",
    "Problem",
    "SPEC_KEYS",
    "Spec",
    "SpecProblems",
    "load_spec",
    "merge_spec",
    "parse_headroom",
    "planning_dtype",
    "reserve_bytes",
    "spec_device",
]
